#!/usr/bin/env bash
# The 8B round with cuBLAS set up two or three ways (profile_round.py --blas), one GPU call, under
# $OUT: torch's default workspace, the engine's 1 KiB one (fast/blas.py), torch's cuBLASLt path.
# bench_cublas_rows.py found the last two drop the down product's split-K reduce at 33-65 rows.
# Each profile ends with the rounds split into draft / tree / verify / commit (--split). A fresh
# machine's 8B warm-up compiles for over 150 s; the later profiles reuse its caches.
#   BLAS="torch engine torch engine" bash bench/gpu_blas_8b.sh   # A B A B (the default)
set -u
OUT=${OUT:-$PWD/gpu-blas-8b-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
limit=210
n=0
for blas in ${BLAS:-torch engine torch engine}; do
    n=$((n + 1))
    (cd bench && timeout "$limit" python3 profile_round.py --device cuda --pair 8b --budgets 32,64 --rounds 20 \
        --window 1280 --top 40 --blas "$blas" --split --out "$OUT/prof-8b-$n-$blas.json") 2>&1 \
        | grep -v "profiler_st\|Loading weights" > "$OUT/prof-8b-$n-$blas.txt"
    echo "== $n $blas"; grep "^\[8b .*wall\|split" "$OUT/prof-8b-$n-$blas.txt"
    limit=130
done
