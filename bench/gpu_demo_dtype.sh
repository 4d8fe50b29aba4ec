#!/usr/bin/env bash
# The demo pair in float32 against bfloat16 on the fast backend, side by side in one run, then the
# demo pair's CUDA identity tests, after a profile of its rounds. One GPU call; writes under $OUT. Its first run (2026-12-05)
# cut the bf16 side off at a 200 s limit: the two sides' warm-ups and 8 prompts take longer.
#   bash bench/gpu_demo_dtype.sh
#   PROFILE=0 TESTS=0 BENCH_TIMEOUT=450 bash bench/gpu_demo_dtype.sh   # the side-by-side run alone
set -u
OUT=${OUT:-$PWD/gpu-demo-dtype-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
# Where a demo round's GPU sits idle (profile_round.py's idle lines), first: it is the cheapest part.
[ "${PROFILE:-1}" = 1 ] && (cd bench && timeout 100 python3 profile_round.py --device cuda --pair demo --budgets 16,32,64 --rounds 40 --top 40 \
    --out "$OUT/prof-demo.json") 2>&1 | grep -v "profiler_st\|Loading weights" > "$OUT/prof-demo.txt"
[ "${PROFILE:-1}" = 1 ] && grep "^\[demo\|idle x" "$OUT/prof-demo.txt" | tail -30
timeout ${BENCH_TIMEOUT:-270} python3 bench/bench_fast.py --device cuda --shapes "" --demo-backends fast,fast-bf16 \
    --demo-prompts 8 --out "$OUT/demo-dtype.json" 2>&1 | grep -v "Loading weights" > "$OUT/demo-dtype.txt"
grep '^\[demo .*{"rows"' "$OUT/demo-dtype.txt" | cut -c1-700
[ "${TESTS:-1}" = 1 ] || exit 0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine/reference/test_cuda_fast.py \
    -k "demo_pair or bf16" > "$OUT/cuda-tests.txt" 2>&1
tail -8 "$OUT/cuda-tests.txt"
