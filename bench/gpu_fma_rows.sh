#!/usr/bin/env bash
# The few-row kernel's elementwise float32 tiles (gemv.FMA_TILES, triton_gemv.rows_fma) on the demo
# pair: the CUDA tests of the kernel (every tiling against float64, the tune, graphs with the kernel
# tuned in equal to AR), a profile of the demo's rounds with the tunes' per-product times, then
# bench_fast's demo tok/s and tau with and without the tiles (fast, fast-nofma), then the CUDA tests
# of the lone AR steps run ahead. One GPU call, most important first. Writes under $OUT.
#   bash bench/gpu_fma_rows.sh
set -u
OUT=${OUT:-$PWD/gpu-fma-rows-out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_site.sh"  # installs the checkout to /tmp/site
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -p no:logging -m cuda \
    tests/engine/reference/test_gemv.py > "$OUT/cuda-tests-gemv.txt" 2>&1
tail -3 "$OUT/cuda-tests-gemv.txt"
(cd bench && timeout ${PROFILE_TIMEOUT:-100} python3 profile_round.py --device cuda --pair demo --budgets 16,32 \
    --rounds 40 --top 12 --out "$OUT/prof-demo-fma.json") 2>&1 | grep -v "profiler_st\|Loading weights" \
    > "$OUT/prof-demo-fma.txt"
grep "few-row kernel\|wall" "$OUT/prof-demo-fma.txt" | tail -8
timeout ${DEMO_TIMEOUT:-200} python3 bench/bench_fast.py --device cuda --shapes "" --demo-backends ${BACKENDS:-fast,fast-nofma} \
    --demo-prompts ${PROMPTS:-8} --demo-budgets 16,32,64 --out "$OUT/demo-fma.json" 2>&1 \
    | grep -v "Loading weights\|profiler_st" > "$OUT/demo-fma.txt"
grep -v "^\[demo" "$OUT/demo-fma.txt" | tail -20
timeout ${HOST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -p no:logging -m cuda \
    tests/engine/reference/test_cuda_fast_host.py > "$OUT/cuda-tests-host.txt" 2>&1
tail -3 "$OUT/cuda-tests-host.txt"
