"""Recording a CUDA graph, the one way every graph of the fast backend is recorded."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# Graph recordings under way (their warm-up runs included). torch.compile'd code runs only inside
# them: there every shape compiles once, while the server warms up. A forward that finds no graph
# runs uncompiled instead, since a new shape there meant a compile of several seconds in the
# middle of serving (the demo pair's DDTree at one session on an H200, bench/RESULTS.md).
_recording = 0


def recording() -> bool:
    """Whether a graph is being recorded (or warmed up for one) on this process."""
    return _recording > 0


@contextlib.contextmanager
def recording_scope() -> Iterator[None]:
    """Mark the code inside as part of a graph recording (record_graph; tests on a CPU)."""
    global _recording
    _recording += 1
    try:
        yield
    finally:
        _recording -= 1


def record_graph(fn, pool, device, runs: int, inference: bool = False):
    """fn warmed up `runs` times on a side stream (lazy kernel, cuBLAS and compile work stays out
    of the graph, as torch.cuda.graph's notes ask), then captured into a graph of this memory
    pool: (graph, what fn returned during the capture: the tensors each replay rewrites).
    inference: do both under torch.inference_mode (what writes inference tensors needs it)."""
    context = torch.inference_mode() if inference else contextlib.nullcontext()
    with context, recording_scope():
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(runs):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out
