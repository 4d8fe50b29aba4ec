#!/usr/bin/env bash
# Issue 14 on a GPU box in one pass: bench_fast.py (1.7B and 8B shapes, the demo pair), then the
# fast backend's CUDA tests. Writes under $OUT (default ./gpu-fast-out). The lent H200 machines
# have torch and transformers but no project venv: the package is installed with --no-deps.
#   bash bench/gpu_fast.sh                 # everything (bench, then the CUDA tests)
#   PART=bench bash bench/gpu_fast.sh      # only the benchmark (bench-fast.{json,txt})
#   PART=tests bash bench/gpu_fast.sh      # only the CUDA tests (cuda-tests.txt)
# A device command may run 10 minutes at most: with both parts, BENCH_TIMEOUT + TEST_TIMEOUT
# stay under that; split into two PART runs when the bench needs longer (BENCH_TIMEOUT=560).
set -u
OUT=${OUT:-$PWD/gpu-fast-out}; mkdir -p "$OUT"
PART=${PART:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rm -rf /tmp/site  # a warm machine keeps the last install, and pip --target does not replace it
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' >> "$OUT/gpu.txt"
if [ "$PART" != tests ]; then
    shapes=${SHAPES:-1.7b,8b}
    timeout ${BENCH_TIMEOUT:-390} python3 bench/bench_fast.py --device cuda --shapes "$shapes" --out "$OUT/bench-fast.json" ${BENCH_ARGS:-} \
        2>&1 | grep -v "Loading weights" | tee "$OUT/bench-fast.txt"
fi
if [ "$PART" != bench ]; then
    tests=${CUDA_TESTS:-tests/engine/reference/test_tree_kernel.py tests/engine/reference/test_tree_attention.py tests/engine/reference/test_cuda.py tests/engine/reference/test_cuda_fast.py tests/engine/reference/test_cuda_fast_host.py tests/engine/reference/test_fast_target.py tests/engine/reference/test_fast_draft.py tests/engine/reference/test_tree_device.py}
    timeout ${TEST_TIMEOUT:-190} python3 -m pytest -q -p no:cacheprovider -m cuda $tests > "$OUT/cuda-tests.txt" 2>&1
    tail -3 "$OUT/cuda-tests.txt"
fi
