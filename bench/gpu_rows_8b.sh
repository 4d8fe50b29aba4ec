#!/usr/bin/env bash
# The few-row kernel (on by default since stop 41, measured then only on the demo pair) on the 8B
# shape, two GPU calls. Writes under $OUT. The targets table (bench_fast.py) is gpu_fast.sh's.
#   bash bench/gpu_rows_8b.sh              # a DDTree round profiled three ways: the tune trying the
#       kernel's wide tiles too (--wide-rows), its default tiles, cuBLAS alone (--no-rows). A fresh
#       machine's 8B warm-up compiles for over 150 s (an H100 ran out of a 150 s limit in it).
#   PART=tiles bash bench/gpu_rows_8b.sh   # the kernel's tilings against cuBLAS (bench_rows_tiles.py)
#   PART=blas bash bench/gpu_rows_8b.sh    # cuBLAS's workspace, torch's against the engine's 1 KiB
#       (fast/blas.py), A B A B (BLAS="torch engine torch engine"; cublaslt is a third choice),
#       budgets 32 and 64, each profile ending with the rounds split (--split)
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
if [ "${PART:-profiles}" = profiles ]; then
    profile wide 200 --wide-rows
    profile rows 180
    profile cublas 170 --no-rows
elif [ "${PART:-profiles}" = blas ]; then
    n=0; limit=210
    for blas in ${BLAS:-torch engine torch engine}; do
        n=$((n + 1))
        profile "$n-$blas" "$limit" --blas "$blas" --budgets 32,64 --split
        limit=130
    done
else  # the tilings at a 65-row verify's products, over a wider grid than the tune's
    timeout ${TILES_TIMEOUT:-170} python3 bench/bench_rows_tiles.py --shapes 8b --rows 65 --out "$OUT/tiles-8b.json" 2>&1 \
        | tee "$OUT/tiles-8b.txt" | grep "^\[8b"
fi
