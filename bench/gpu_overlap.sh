#!/usr/bin/env bash
# Rounds on the KV pool run ahead of the host (fast/batch_graph.py), measured on and off in one
# call: issue 15's 1.7B grid with a server per LOOPS value (process: the default; process+noahead:
# --disable-overlap-schedule) and every in-process cell run again with it off (--again noahead);
# then, unless TESTS=0, the CUDA tests of the pool's graphed rounds. Writes under $OUT (grid-$NAME.*,
# the first server's turn trace, cuda-pool-tests.txt). .whl carried (bench/gpu_pool.sh says how).
#   bash bench/gpu_overlap.sh                                          # AR, both servers, then tests
#   TESTS=0 ALGORITHMS=ar,dflash,ddtree LOOPS=process NAME=1.7b-overlap-full TIME_BUDGET=520 \
#       GRID_TIMEOUT=540 bash bench/gpu_overlap.sh                     # every algorithm, one server
set -u
OUT=${OUT:-$PWD/gpu-overlap-out}; mkdir -p "$OUT"
NAME=${NAME:-1.7b-overlap} PART=grid SHAPE=${SHAPE:-1.7b} VERIFY_GRID=--skip-batching TRACE=1 \
    TIME_BUDGET=${TIME_BUDGET:-400} GRID_TIMEOUT=${GRID_TIMEOUT:-420} \
    GRID_ARGS="--concurrency ${CONCURRENCY:-16,64,1,4} --waves 4 --enable-mixed-chunk --algorithms ${ALGORITHMS:-ar} \
--engine-loops ${LOOPS:-process,process+noahead} --again ${AGAIN:-noahead}" OUT="$OUT" bash bench/gpu_pool.sh
if [ "${TESTS:-1}" = 1 ]; then
    PART=tests TEST_TIMEOUT=${TEST_TIMEOUT:-150} OUT="$OUT" \
        CUDA_TESTS="tests/engine/reference/test_cuda_pool.py::test_ar_rounds_run_ahead_graphed_decode_as_serial tests/engine/reference/test_cuda_pool.py::test_graphed_rounds_equal_serial" \
        bash bench/gpu_pool.sh
fi
