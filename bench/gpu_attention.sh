#!/usr/bin/env bash
# The tree-attention kernel's tilings at a batched round's shapes, on a GPU box in one call: a
# 1.7B AR round at b=16 spent about a quarter of its GPU time in attend_split (bench/RESULTS.md,
# "Row ops and the batched draft head"), with tilings fitted on one row. Writes under $OUT.
#   bash bench/gpu_attention.sh            # b=16; B=64 bash bench/gpu_attention.sh for another batch
# Its runs at b=4, 8 and 16 gave default_config (fast/tree_attention.py) its batched rule, from
# BATCHED_PAIRS (b=2 unmeasured). Check changes with PART=tests bash bench/gpu_pool.sh. Then it
# profiles a 1.7B round at b=B with that tiling and with the one-row one, its end-to-end effect.
set -u
OUT=${OUT:-$PWD/gpu-attention-out}; mkdir -p "$OUT"
B=${B:-16}
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
timeout 200 python3 bench/bench_tree_attention.py --shapes 1.7b,8b --nodes 1,17 --contexts 512,1024 --batch "$B" \
    --sweep --variants --out "$OUT/attention-b$B.json" > "$OUT/attention-b$B.txt" 2>&1
tail -12 "$OUT/attention-b$B.txt" | cut -c1-300
timeout 60 python3 bench/bench_tree_attention.py --shapes demo --nodes 1,33 --contexts 512 --batch "$B" \
    --sweep --variants --out "$OUT/attention-demo-b$B.json" > "$OUT/attention-demo-b$B.txt" 2>&1
tail -4 "$OUT/attention-demo-b$B.txt" | cut -c1-300
# A batched round end to end, the batched tiling against the one-row one (ATTENTION_AB=0 skips it).
if [ "${ATTENTION_AB:-1}" = 1 ]; then
    for tag in batched one-row; do
        flag=""; [ "$tag" = one-row ] && flag=--one-row-attention
        (cd bench && timeout 130 python3 profile_round.py --device cuda --pair 1.7b --batch "$B" --budgets 16 \
            --rounds 40 --top 30 $flag --out "$OUT/prof-1.7b-b$B-$tag.json") 2>&1 \
            | grep -v "profiler_st\|Loading weights" > "$OUT/prof-1.7b-b$B-$tag.txt"
        grep "^\[1.7b" "$OUT/prof-1.7b-b$B-$tag.txt" | tail -3
    done
fi
