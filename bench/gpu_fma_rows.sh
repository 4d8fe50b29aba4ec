#!/usr/bin/env bash
# The few-row kernel's elementwise float32 tiles (gemv.FMA_TILES, triton_gemv.rows_fma), on and
# off, on the demo pair: the CUDA tests (every tiling against float64, the tune, graphs with the
# kernel tuned in equal to AR; the lone AR steps run ahead and the pool's rounds), then bench_fast's
# demo tok/s and tau with and without them (fast, fast-nofma), then one profile with them on.
# One GPU call. Writes under $OUT.
#   bash bench/gpu_fma_rows.sh
set -u
OUT=${OUT:-$PWD/gpu-fma-rows-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider -p no:logging -m cuda \
    tests/engine/reference/test_gemv.py tests/engine/reference/test_cuda_fast_host.py \
    tests/engine/reference/test_cuda_pool.py::test_ar_rounds_run_ahead_graphed_decode_as_serial \
    "tests/engine/reference/test_cuda_fast.py::test_graphs_demo_pair_fp32_equal_ar_and_transformers" \
    > "$OUT/cuda-tests.txt" 2>&1
tail -3 "$OUT/cuda-tests.txt"
timeout ${DEMO_TIMEOUT:-200} python3 bench/bench_fast.py --device cuda --shapes "" --demo-backends fast,fast-nofma \
    --demo-prompts ${PROMPTS:-8} --demo-budgets 16,32,64 --out "$OUT/demo-fma.json" 2>&1 \
    | grep -v "Loading weights\|profiler_st" > "$OUT/demo-fma.txt"
grep -v "^\[demo" "$OUT/demo-fma.txt" | tail -20
(cd bench && timeout ${PROFILE_TIMEOUT:-120} python3 profile_round.py --device cuda --pair demo --budgets 16,32 \
    --rounds 40 --top 12 --split --out "$OUT/prof-demo-fma.json") 2>&1 | grep -v "profiler_st\|Loading weights" \
    > "$OUT/prof-demo-fma.txt"
grep "^\[demo\] few-row\|wall" "$OUT/prof-demo-fma.txt" | tail -12
