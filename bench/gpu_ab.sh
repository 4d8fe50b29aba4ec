#!/usr/bin/env bash
# This tree's server against an older tree's, A B A B on one GPU box, through bench/gpu_pool.sh's
# grid (each side's own bench script, client and server). The older tree goes in BASE, made here
# first and carried with the working tree (untracked, not ignored):
#   rm -rf .base && mkdir .base && git archive REV | tar -x -C .base && rm -rf .base/bench/results \
#       && find .base/assets/demo -type f -size +50k -delete    # the grid on random weights needs no demo pair (it does need assets/prompts)
#   (and, to compare a harness change's records on both sides, that one file from this tree:
#    git show HEAD:bench/serving_grid.py > .base/bench/serving_grid.py)
#   BASE=.base RUNS="base new base new" GRID_ARGS="--concurrency 64,16,1 --waves 8 --enable-mixed-chunk --algorithms ar" \
#       bash bench/gpu_ab.sh
# Writes $OUT/grid-ab-<side><n>.{json,txt} (and the turn traces, gzipped), and prints each run's summary.
set -u
OUT=${OUT:?set OUT}
BASE=${BASE:-.base}
[ -d "$BASE" ] || { echo "no $BASE: see this script's header" >&2; exit 1; }
# The grid's prompts are an asset: a base made without them fails every cell (12-07's first try).
[ -s "$BASE/assets/prompts/code.jsonl" ] || { echo "$BASE has no assets/prompts/code.jsonl: see this script's header" >&2; exit 1; }
ln -sfn "$PWD/.whl" "$BASE/.whl"
n=0
for side in ${RUNS:-base new base new}; do
    n=$((n + 1))
    dir=.; [ "$side" = base ] && dir=$BASE
    (cd "$dir" && OUT=$OUT NAME=ab-$side$n PART=grid SHAPE=${SHAPE:-1.7b} VERIFY_GRID=--skip-batching TRACE=1 \
        TIME_BUDGET=${TIME_BUDGET:-140} GRID_TIMEOUT=${GRID_TIMEOUT:-170} GRID_ARGS="${GRID_ARGS:-}" \
        bash bench/gpu_pool.sh > /dev/null 2>&1)
    echo "== $side$n"
    grep -A9 "^process (" "$OUT/grid-ab-$side$n.txt"
    grep "^c=" "$OUT/grid-ab-$side$n.txt" | head -6
done
