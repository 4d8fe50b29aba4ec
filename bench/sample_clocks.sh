#!/usr/bin/env bash
# Every 0.25 s until killed: the time, the GPU's SM clock (MHz), the CPU cores' mean clock (MHz)
# and the 1-minute load, one line each, into $1. Run beside a benchmark on a GPU box to see
# whether the clocks differ between its parts (which part ran when: timestamp its output too).
out=${1:?usage: sample_clocks.sh FILE}
echo "time sm_mhz cpu_mhz load1" > "$out"
while :; do
    sm=$(nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits 2>/dev/null | head -1)
    cpu=$(awk -F: '/^cpu MHz/ {s += $2; n++} END {if (n) printf "%.0f", s / n}' /proc/cpuinfo)
    echo "$(date +%T.%2N) ${sm:--} ${cpu:--} $(cut -d' ' -f1 /proc/loadavg)" >> "$out"
    sleep 0.25
done
