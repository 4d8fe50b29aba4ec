#!/usr/bin/env bash
# The 8B round with cuBLAS set up three ways (profile_round.py --blas), one GPU call, under $OUT:
# torch's default, its cuBLASLt path, a 1 KiB workspace. bench_cublas_rows.py found the last two
# drop the down product's split-K reduce at 33-65 rows. A fresh machine's 8B warm-up compiles for
# over 150 s; the later profiles reuse its caches.
set -u
OUT=${OUT:-$PWD/gpu-blas-8b-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
limit=210
for blas in ${BLAS:-default cublaslt small-workspace}; do
    (cd bench && timeout "$limit" python3 profile_round.py --device cuda --pair 8b --budgets 32,64 --rounds 20 \
        --window 1280 --top 40 --blas "$blas" --out "$OUT/prof-8b-$blas.json") 2>&1 \
        | grep -v "profiler_st\|Loading weights" > "$OUT/prof-8b-$blas.txt"
    grep "^\[8b .*wall" "$OUT/prof-8b-$blas.txt"
    limit=130
done
