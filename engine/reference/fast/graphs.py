"""Recording a CUDA graph, the one way every graph of the fast backend is recorded."""

from __future__ import annotations

import contextlib

import torch


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
