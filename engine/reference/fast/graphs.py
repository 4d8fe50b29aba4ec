"""Recording a CUDA graph, the one way every graph of the fast backend is recorded."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

# Warm-ups under way (FastPath.warmup). torch.compile'd code runs only inside them: there every
# shape the warm-up's captures need compiles once, before the server takes requests. Anything
# later, a forward with no graph or a graph captured on first use (a longer context, a prefill
# bucket), runs uncompiled: on an H200 the demo pair's warm-up logs its recompiles about 6 s apart
# (bench/RESULTS.md), and mid-serving every stream would wait through one.
# Per thread: a warm-up runs on the thread that calls it, and another engine's rounds on another
# thread of the process must not compile meanwhile.
_state = threading.local()


def warming_up() -> bool:
    """Whether an engine warm-up is under way on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def warmup_scope() -> Iterator[None]:
    """Mark the code inside as a warm-up (FastPath.warmup; tests on a CPU)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def record_graph(fn, pool, device, runs: int, inference: bool = False):
    """fn warmed up `runs` times on a side stream (lazy kernel, cuBLAS and compile work stays out
    of the graph, as torch.cuda.graph's notes ask), then captured into a graph of this memory
    pool: (graph, what fn returned during the capture: the tensors each replay rewrites).
    inference: do both under torch.inference_mode (what writes inference tensors needs it)."""
    context = torch.inference_mode() if inference else contextlib.nullcontext()
    with context:
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
