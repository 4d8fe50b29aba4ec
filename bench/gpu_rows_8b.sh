#!/usr/bin/env bash
# The few-row kernel (on by default since stop 41, measured then only on the demo pair) on the 8B
# shape, in one GPU call: a DDTree round profiled with the kernel tuned in and with cuBLAS alone
# (profile_round.py --no-rows), then the kernel's tilings against cuBLAS (bench_rows_tiles.py). Writes
# under $OUT. The targets table (bench_fast.py) is a separate call: gpu_fast.sh.
#   bash bench/gpu_rows_8b.sh
#   PART=tiles bash bench/gpu_rows_8b.sh   # only bench_rows_tiles.py
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
if [ "${PART:-all}" != tiles ]; then  # PART=tiles: only the tilings (the shortest call)
    profile rows 130
    profile cublas 110 --no-rows
fi
# The kernel's tilings against cuBLAS at a 65-row verify's products, over a wider grid than the tune's.
timeout ${TILES_TIMEOUT:-170} python3 bench/bench_rows_tiles.py --shapes 8b --rows 65 --out "$OUT/tiles-8b.json" 2>&1 \
    | tee "$OUT/tiles-8b.txt" | grep "^\[8b"
