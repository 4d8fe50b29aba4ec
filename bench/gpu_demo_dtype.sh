#!/usr/bin/env bash
# The demo pair in float32 against bfloat16 on the fast backend, side by side in one run, then the
# tree-attention tilings at batches 4 and 8 (between the one-row fit and b=16), then the demo
# pair's CUDA identity tests. One GPU call; writes under $OUT.
#   bash bench/gpu_demo_dtype.sh
set -u
OUT=${OUT:-$PWD/gpu-demo-dtype-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
timeout 200 python3 bench/bench_fast.py --device cuda --shapes "" --demo-backends fast,fast-bf16 \
    --demo-prompts 8 --out "$OUT/demo-dtype.json" 2>&1 | grep -v "Loading weights" > "$OUT/demo-dtype.txt"
grep '^\[demo .*{"rows"' "$OUT/demo-dtype.txt" | cut -c1-700
for B in 4 8; do
    timeout 60 python3 bench/bench_tree_attention.py --shapes 1.7b,8b --nodes 1,17 --contexts 1024 --batch "$B" \
        --sweep --variants --out "$OUT/attention-b$B.json" > "$OUT/attention-b$B.txt" 2>&1
    tail -4 "$OUT/attention-b$B.txt" | cut -c1-200
done
timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine/reference/test_cuda_fast.py \
    -k "demo_pair or bf16" > "$OUT/cuda-tests.txt" 2>&1
tail -8 "$OUT/cuda-tests.txt"
