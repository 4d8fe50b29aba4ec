#!/usr/bin/env bash
# AR rounds on the KV pool run ahead of the host (fast/batch_graph.py), measured on and off in one
# call: the CUDA tests of the pool's graphed rounds, then issue 15's 1.7B AR grid with two servers
# (the default and --disable-overlap-schedule, in the order LOOPS gives) and every in-process cell
# run again with it off (--again noahead). Writes under $OUT (grid-$NAME.*, the first server's turn
# trace, cuda-pool-tests.txt). .whl carried (bench/gpu_pool.sh's header says how to fill it).
#   bash bench/gpu_overlap.sh
#   LOOPS=process+noahead,process NAME=1.7b-overlap-b bash bench/gpu_overlap.sh   # the other order
set -u
OUT=${OUT:-$PWD/gpu-overlap-out}; mkdir -p "$OUT"
PART=tests TEST_TIMEOUT=${TEST_TIMEOUT:-150} CUDA_TESTS="tests/engine/reference/test_cuda_pool.py::test_ar_rounds_run_ahead_graphed_decode_as_serial tests/engine/reference/test_cuda_pool.py::test_graphed_rounds_equal_serial" \
    OUT="$OUT" bash bench/gpu_pool.sh
NAME=${NAME:-1.7b-overlap} PART=grid SHAPE=${SHAPE:-1.7b} VERIFY_GRID=--skip-batching TRACE=1 \
    TIME_BUDGET=${TIME_BUDGET:-400} GRID_TIMEOUT=${GRID_TIMEOUT:-420} \
    GRID_ARGS="--concurrency ${CONCURRENCY:-16,64,1,4} --waves 4 --enable-mixed-chunk --algorithms ${ALGORITHMS:-ar} \
--engine-loops ${LOOPS:-process,process+noahead} --again noahead" OUT="$OUT" bash bench/gpu_pool.sh
