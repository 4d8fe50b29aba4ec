#!/usr/bin/env bash
# AR rounds on the KV pool run ahead of the host (fast/batch_graph.py), measured on and off in one
# call: issue 15's 1.7B AR grid with two servers (the default and --disable-overlap-schedule) and
# every in-process cell run again with it off (--again noahead); then the pool's CUDA tests.
# Writes under $OUT (grid-1.7b-overlap.*, the two servers' turn traces, cuda-pool-tests.txt).
# .whl carried (bench/gpu_pool.sh's header says how to fill it).
#   bash bench/gpu_overlap.sh
set -u
OUT=${OUT:-$PWD/gpu-overlap-out}; mkdir -p "$OUT"
NAME=${NAME:-1.7b-overlap} PART=grid SHAPE=1.7b VERIFY_GRID=--skip-batching TRACE=1 \
    TIME_BUDGET=${TIME_BUDGET:-420} GRID_TIMEOUT=${GRID_TIMEOUT:-440} \
    GRID_ARGS="--concurrency ${CONCURRENCY:-16,64,1,4} --waves 4 --enable-mixed-chunk --algorithms ${ALGORITHMS:-ar} \
--engine-loops process,process+noahead --again noahead" OUT="$OUT" bash bench/gpu_pool.sh
PART=tests TEST_TIMEOUT=${TEST_TIMEOUT:-110} CUDA_TESTS=tests/engine/reference/test_cuda_pool.py OUT="$OUT" \
    bash bench/gpu_pool.sh
