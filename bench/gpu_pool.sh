#!/usr/bin/env bash
# Issue 15 on a GPU box: the KV pool's CUDA tests, then bench_server.py --grid (through the HTTP
# server with the sweep client, and the same loop in process) and --verify-grid. Writes under $OUT.
# The lent H200 machines lack starlette, uvicorn, uvloop and httptools: put their wheels (Python
# 3.12 there) in .whl/ first, here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl starlette==<venv's> uvicorn==<venv's> uvloop==<venv's> httptools==<venv's>
#   and for a grid with --py-spy in GRID_ARGS, py-spy's (the same with --platform manylinux2014_x86_64 py-spy)
#   PART=tests bash bench/gpu_pool.sh        # the CUDA tests (cuda-pool-tests.txt)
#   PART=grid SHAPE=1.7b bash bench/gpu_pool.sh  # the grid (grid-$SHAPE.{json,txt}); random weights
#   PART=grid SHAPE=pair bash bench/gpu_pool.sh  # the trained demo pair (its real acceptance)
#       (NAME=x names the outputs grid-x.* instead)
#   PART=mixed SHAPE=1.7b bash bench/gpu_pool.sh # the grid without, then with --enable-mixed-chunk
#       (grid-$SHAPE-mix-{off,on}.*), side by side in one call.
#   TRACE=1 with a grid: the server's --trace-turns, summarised by bench/turn_trace.py at the
#       end of grid-NAME.txt (the trace gzipped beside it, turns-NAME-LOOP.jsonl.gz, one per
#       --engine-loops value in GRID_ARGS: process, process-w4 for 4 HTTP processes, thread). A cold machine's first server start
#       takes 110-200 s on the 1.7B shape (48-73 s once its kernel caches are warm), the in-process
#       engine's warm-up 40-60 s more: the server's cells get half of what is left of 90% of
#       TIME_BUDGET once it is up, so on a cold machine give a grid 480 s or more, and put the
#       concurrencies that matter most first in GRID_ARGS (they run in the order given).
set -u
OUT=${OUT:-$PWD/gpu-pool-out}; mkdir -p "$OUT"
PART=${PART:-all}
SHAPE=${SHAPE:-1.7b}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rm -rf /tmp/site  # a warm machine keeps the last install, and pip --target does not replace it
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/tmp/install.log 2>&1 \
    || { cat /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site
python3 -c "import aiohttp, httpx, starlette, uvicorn" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if [ "$PART" = all ] || [ "$PART" = tests ]; then
    tests=${CUDA_TESTS:-tests/engine/reference/test_cuda_pool.py tests/engine/reference/test_batch_tree.py}
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -p no:logging -m cuda -x $tests > "$OUT/cuda-pool-tests.txt" 2>&1
    tail -15 "$OUT/cuda-pool-tests.txt"
fi
grid() {  # grid NAME EXTRA_ARGS...: one bench_server.py --grid run, written as grid-NAME.*
    local name=$1; shift
    shape="--random-shape $SHAPE"; [ "$SHAPE" = pair ] && shape=""
    trace=""; [ "${TRACE:-0}" = 1 ] && trace="--trace-turns $OUT/turns-$name"
    timeout ${GRID_TIMEOUT:-420} python3 bench/bench_server.py --device cuda $shape --grid ${VERIFY_GRID:---verify-grid} \
        --skip-batching --context-window ${CONTEXT_WINDOW:-2048} --max-new-tokens ${MAX_NEW:-64} \
        --time-budget ${TIME_BUDGET:-380} --out "$OUT/grid-$name.json" $trace ${GRID_ARGS:-} "$@" 2>&1 \
        | grep -v "Loading weights\|Writing model" | tee "$OUT/grid-$name.txt"
    # A call brings back only a few files: the trace's summary and the server log's lines other
    # than its access log go at the end of grid-NAME.txt, the trace itself gzipped beside it.
    # One trace per --engine-loops value (turns-NAME-process.jsonl, turns-NAME-process-w4.jsonl, ...).
    for tr in "$OUT"/turns-"$name"-*.jsonl; do
        [ -n "$trace" ] && [ -f "$tr" ] || continue
        loop=${tr#"$OUT/turns-$name-"}; loop=${loop%.jsonl}
        echo "== bench/turn_trace.py --loop $loop" >> "$OUT/grid-$name.txt"
        python3 bench/turn_trace.py "$tr" --grid "$OUT/grid-$name.json" --loop "$loop" >> "$OUT/grid-$name.txt" 2>&1
        gzip -f "$tr"
    done
    for log in /tmp/bench-server-*/server-grid*.log; do
        [ -f "$log" ] || continue
        echo "== $(basename "$log"), access lines left out" >> "$OUT/grid-$name.txt"
        grep -v "server.access: " "$log" >> "$OUT/grid-$name.txt"
        rm -f "$log"
    done
}
if [ "$PART" = mixed ]; then
    grid "$SHAPE-mix-off"
    grid "$SHAPE-mix-on" --enable-mixed-chunk
elif [ "$PART" != tests ]; then
    grid "${NAME:-$SHAPE}"
fi
