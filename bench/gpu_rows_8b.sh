#!/usr/bin/env bash
# The few-row kernel (on by default since stop 41, measured then only on the demo pair) on the 8B
# and 1.7B shapes, in one GPU call: a DDTree round profiled with the kernel tuned in and with
# cuBLAS alone (profile_round.py --no-rows), then bench_fast's targets table (kernel on). Writes
# under $OUT.
#   bash bench/gpu_rows_8b.sh
set -u
OUT=${OUT:-$PWD/gpu-rows-8b-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
profile() {
    tag=$1; limit=$2; shift 2
    (cd bench && timeout "$limit" python3 profile_round.py --device cuda --pair 8b --budgets 64,256 --rounds 20 \
        --window 1280 --top 40 --out "$OUT/prof-8b-$tag.json" "$@") 2>&1 | grep -v "profiler_st\|Loading weights" \
        > "$OUT/prof-8b-$tag.txt"
    grep "^\[8b\|idle x" "$OUT/prof-8b-$tag.txt" | tail -16
}
profile rows 150
profile cublas 130 --no-rows
timeout ${BENCH_TIMEOUT:-280} python3 bench/bench_fast.py --device cuda --shapes 8b,1.7b --nodes 1,16,64,256 \
    --budgets 16,64,256 --serving-window 0 --demo-prompts 0 --slow-tokens 16 --out "$OUT/bench-fast.json" 2>&1 \
    | grep -v "Loading weights" > "$OUT/bench-fast.txt"
grep -v "captured\|timing the\|compiling" "$OUT/bench-fast.txt" | tail -30 | cut -c1-300
