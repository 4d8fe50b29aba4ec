#!/usr/bin/env bash
# The few-row kernel (fast/gemv.py's rows, on by default since its first H200 run) on a GPU box in
# one call: the demo pair's round profiled with cuBLAS alone and with the kernel, the demo's tok/s
# both ways side by side, then its CUDA tests. Writes under $OUT.
#   bash bench/gpu_rows.sh
set -u
OUT=${OUT:-$PWD/gpu-rows-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
profile() {
    tag=$1; limit=$2; shift 2
    (cd bench && timeout "$limit" python3 profile_round.py --device cuda --pair demo --budgets 16,32,64 --rounds 40 \
        --top 70 --out "$OUT/prof-demo-$tag.json" "$@") 2>&1 | grep -v "profiler_st\|Loading weights" > "$OUT/prof-demo-$tag.txt"
    grep "^\[demo" "$OUT/prof-demo-$tag.txt" | tail -7
}
profile cublas 120 --no-rows
profile rows 140
timeout 150 python3 bench/bench_fast.py --device cuda --shapes "" --demo-backends fast-cublas,fast --demo-prompts 8 \
    --out "$OUT/demo-fast.json" 2>&1 | grep -v "Loading weights" > "$OUT/demo-fast.txt"
tail -4 "$OUT/demo-fast.txt" | cut -c1-400
timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine/reference/test_gemv.py \
    tests/engine/reference/test_cuda_rows.py tests/engine/reference/test_cuda_fast.py > "$OUT/cuda-tests.txt" 2>&1
tail -15 "$OUT/cuda-tests.txt"
