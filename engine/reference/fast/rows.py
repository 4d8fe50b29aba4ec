"""Few-row float32 linears on CUDA, each computed the way that runs faster on this device.

For x [m, k] @ W^T with 2 <= m <= 16 rows in float32, cuBLAS on an H200 (torch 2.11) picked a
kernel of a handful of two-warp blocks for some shapes: [16, 256] x [256, 128] took 52 us, where
the same product with its operands swapped, (W @ x^T)^T, took 7, and [17, 256] x [256, 128] took
10 (bench/bench_small_gemm.py). Which shapes suffer depends on the cuBLAS build and the device, so
the choice is measured, once per shape, as CUDA graph replays (how the engine runs them), and a
swap is kept only where it wins by a clear margin. bf16/fp16 and the CPU always take F.linear:
nothing was seen to need it there.
"""

from __future__ import annotations

import statistics
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

_MARGIN = 0.8  # a swap must take at most this share of F.linear's time


def _swapped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def replay_us(fn, device: torch.device, launches: int = 10, repeats: int = 5) -> float:
    """us per call of fn, timed as replays of a CUDA graph of `launches` calls, median of `repeats`."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return statistics.median(times)


class RowLinears:
    """linear(module, x): F.linear, or the swapped product for the (m, k, n) shapes `tune` found
    faster that way. `swap` holds those shapes; it is filled before any graph capture or
    torch.compile trace, and only read after."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.active = device.type == "cuda" and dtype == torch.float32
        self.device = device
        self.dtype = dtype
        self.swap: set[tuple[int, int, int]] = set()
        self.measured: dict[tuple[int, int, int], tuple[float, float]] = {}

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.swap and x.dim() == 2 and (x.shape[0], *module.weight.shape[::-1]) in self.swap:
            return _swapped(x, module.weight, module.bias)
        return module(x)

    def tune(self, linears: Iterable[nn.Linear], rows: Iterable[int]) -> None:
        """Measure F.linear against the swapped product for every (rows, linear) shape not yet
        measured. A no-op off CUDA or outside float32, and inside a capture."""
        if not self.active or torch.cuda.is_current_stream_capturing():
            return
        shapes = {(m, int(w.weight.shape[1]), int(w.weight.shape[0])) for w in linears for m in rows if 2 <= m <= 16}
        for m, k, n in sorted(shapes - set(self.measured)):
            x = torch.randn(m, k, device=self.device, dtype=self.dtype)
            w = torch.randn(n, k, device=self.device, dtype=self.dtype) / k ** 0.5
            plain = replay_us(lambda: F.linear(x, w), self.device)
            swapped = replay_us(lambda: _swapped(x, w, None), self.device)
            self.measured[(m, k, n)] = (round(plain, 2), round(swapped, 2))
            if swapped <= _MARGIN * plain:
                self.swap.add((m, k, n))
