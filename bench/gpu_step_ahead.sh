#!/usr/bin/env bash
# A lone greedy AR session's next step queued before its token is read (fast/step_ahead.py): the
# CUDA tests that cover it, then on and off in the same process, A B A B (profile_round.py
# --draft-ahead both --repeats 2), on the 8B shape and the demo pair. One GPU call. Writes under $OUT.
#   bash bench/gpu_step_ahead.sh
# A fresh machine's 8B warm-up compiles for over 150 s: the 8B profile has the largest limit. The tests
# compile first on a cold machine: 150 s cut the last one short there (bench/RESULTS.md).
set -u
OUT=${OUT:-$PWD/gpu-step-ahead-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -p no:logging -m cuda tests/engine/reference/test_cuda_fast_host.py \
    "tests/engine/reference/test_cuda_fast.py::test_graphs_demo_pair_fp32_equal_ar_and_transformers" \
    > "$OUT/cuda-tests.txt" 2>&1
tail -3 "$OUT/cuda-tests.txt"
profile() {
    tag=$1; limit=$2; shift 2
    (cd bench && timeout "$limit" python3 profile_round.py --device cuda --draft-ahead both --repeats 2 --rounds 40 \
        --top 30 --out "$OUT/prof-$tag.json" "$@") 2>&1 | grep -v "profiler_st\|Loading weights" > "$OUT/prof-$tag.txt"
    grep "^\[" "$OUT/prof-$tag.txt" | tail -24
}
profile 8b ${EIGHT_TIMEOUT:-280} --pair 8b --budgets 64 --window 1280 --split
profile demo ${DEMO_TIMEOUT:-120} --pair demo --budgets 16,32
