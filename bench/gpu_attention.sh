#!/usr/bin/env bash
# The tree-attention kernel's tilings at a batched round's shapes, on a GPU box in one call: a
# 1.7B AR round at b=16 spent about a quarter of its GPU time in attend_split (bench/RESULTS.md,
# "Row ops and the batched draft head"), with tilings fitted on one row. Writes under $OUT.
#   bash bench/gpu_attention.sh            # b=16; B=64 bash bench/gpu_attention.sh for another batch
# Its runs at b=4, 8 and 16 gave default_config (fast/tree_attention.py) its batched rule, from
# BATCHED_PAIRS (b=2 unmeasured). Check changes with PART=tests bash bench/gpu_pool.sh.
set -u
OUT=${OUT:-$PWD/gpu-attention-out}; mkdir -p "$OUT"
B=${B:-16}
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
timeout 280 python3 bench/bench_tree_attention.py --shapes 1.7b,8b --nodes 1,17 --contexts 512,1024 --batch "$B" \
    --sweep --variants --out "$OUT/attention-b$B.json" > "$OUT/attention-b$B.txt" 2>&1
tail -12 "$OUT/attention-b$B.txt" | cut -c1-300
timeout 120 python3 bench/bench_tree_attention.py --shapes demo --nodes 1,33 --contexts 512 --batch "$B" \
    --sweep --variants --out "$OUT/attention-demo-b$B.json" > "$OUT/attention-demo-b$B.txt" 2>&1
tail -4 "$OUT/attention-demo-b$B.txt" | cut -c1-300
