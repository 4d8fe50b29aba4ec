"""Few-row float32 linears on CUDA, each computed the way that runs faster on this device.

For x [m, k] @ W^T with 2 <= m <= 16 rows in float32, cuBLAS on an H200 (torch 2.11) picked a
kernel of a handful of two-warp blocks for some shapes: [16, 256] x [256, 128] took 52 us, where
the same product with its operands swapped, (W @ x^T)^T, took 7, and [17, 256] x [256, 128] took
10 (bench/bench_small_gemm.py). Which shapes suffer depends on the cuBLAS build and the device, so
the choice is measured, once per shape, as CUDA graph replays (how the engine runs them), and a
swap is kept only where it wins by a clear margin. bf16/fp16 and the CPU always take F.linear:
nothing was seen to need it there.

The few-row kernel of fast/gemv.py (triton_gemv.rows) is a third candidate, for up to
gemv.ROWS_MAX rows: on an H200 cuBLAS took 6-8 us for most float32 products of 8-32 rows by 256
inputs that bench_small_gemm.py timed (3-4 for a few, 31-52 for others), where a one-row GEMV
took 2.5.

Only the drafter uses it (fast/draft.py). Its compiled block always has B rows, so a choice never
adds a torch.compile trace. The target's layers do not: their compiled layer serves every query
bucket, and a choice per row count would cost one compile per swapped count.
"""

from __future__ import annotations

import logging
import statistics
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_MARGIN = 0.8  # a swap must take at most this share of F.linear's time


def _swapped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def replay_us(fn, device: torch.device, launches: int = 10, repeats: int = 5) -> float:
    """us per call of fn, timed as replays of a CUDA graph of `launches` calls, median of `repeats`,
    on `device` whichever device is current."""
    with torch.cuda.device(device):
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
            start.record(torch.cuda.current_stream(device))
            graph.replay()
            end.record(torch.cuda.current_stream(device))
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
        self.kernel: dict[tuple[int, int, int], object] = {}  # (m, k, n) -> gemv.RowsConfig
        self.kernels = True  # tune tries the few-row kernel too (Gemv.rows says why); False: cuBLAS alone
        self.fma = True  # and its elementwise tiles (gemv.FMA_TILES; Gemv.fma_rows)
        # (m, k, n) -> (F.linear us, swapped us or None, best few-row kernel us or None)
        self.measured: dict[tuple[int, int, int], tuple[float, float | None, float | None]] = {}

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if (self.swap or self.kernel) and x.dim() == 2:
            key = (x.shape[0], *module.weight.shape[::-1])
            config = self.kernel.get(key)
            if config is not None:
                from ddtree.engine.reference.fast.gemv import gemm_rows

                return gemm_rows(x, module.weight, module.bias, config)
            if key in self.swap:
                return _swapped(x, module.weight, module.bias)
        return module(x)

    def tune(self, linears: Iterable[nn.Linear], rows: Iterable[int]) -> None:
        """Measure F.linear against the swapped product for every (rows, linear) shape not yet
        measured, each on the linear's own weight and bias (no copy of a large head) and random
        rows. A no-op off CUDA or outside float32, and inside a capture."""
        if not self.active or torch.cuda.is_current_stream_capturing():
            return
        from ddtree.engine.reference.fast import gemv, tree_attention

        kernels = self.kernels and tree_attention.available()
        todo: dict[tuple[int, int, int], nn.Linear] = {}
        for lin in linears:
            n, k = (int(d) for d in lin.weight.shape)
            for m in rows:
                if 2 <= m <= (gemv.ROWS_MAX if kernels else 16) and (m, k, n) not in self.measured:
                    todo.setdefault((m, k, n), lin)
        for (m, k, n), lin in sorted(todo.items(), key=lambda item: item[0]):
            x = torch.randn(m, k, device=self.device, dtype=self.dtype)
            plain = replay_us(lambda: F.linear(x, lin.weight, lin.bias), self.device)
            swapped = replay_us(lambda: _swapped(x, lin.weight, lin.bias), self.device) if m <= 16 else None
            best = None
            if kernels:
                times = {}
                for c in gemv.rows_configs(m, fma=self.fma):
                    try:
                        times[c] = replay_us(lambda c=c: gemv.launch_rows(x, lin.weight, lin.bias, c), self.device)
                    except Exception as exc:  # noqa: BLE001 - as Gemv.tune_rows: a tiling this GPU cannot run
                        log.info("few-row tiling %s does not run at %s: %s", c, (m, k, n), str(exc)[:120])
                best = min(times, key=times.get) if times else None
            kernel = times[best] if best is not None else None
            self.measured[(m, k, n)] = (round(plain, 2), None if swapped is None else round(swapped, 2),
                                        None if kernel is None else round(kernel, 2))
            # The fastest way that beats F.linear by the margin.
            ways = [(t, way) for t, way in ((swapped, "swap"), (kernel, "kernel")) if t is not None and t <= _MARGIN * plain]
            if ways and min(ways)[1] == "kernel":
                self.kernel[(m, k, n)] = best
            elif ways:
                self.swap.add((m, k, n))
        if todo:
            log.info("few-row float32 products (rows, in, out: F.linear us, swapped us, kernel us): %s; "
                     "swapped: %s; kernel: %s", {key: self.measured[key] for key in sorted(todo)}, sorted(self.swap),
                     sorted(self.kernel))
