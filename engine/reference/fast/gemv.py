"""One-row linears (a decode step's x [1, K] @ W^T) as a GEMV kernel, where it beats cuBLAS here.

Why: in an H200 profile of the Qwen3-8B AR step (bench/RESULTS.md, fifth pass), cuBLAS ran the
fused gate/up product at 97% of the bandwidth the floor assumes, but o_proj and down_proj as
split-K kernels (each with a reduce kernel and a small copy kernel after it) at 63% and 81%, and
the fused q/k/v product at 78%: about 12 us a layer, 0.45 ms a step, above what their weights
take to stream. A one-row product needs no tensor cores: each program here reads BLOCK_N rows of
W once, contiguous along K, and sums in float32, so every output is written by one program and
nothing is reduced afterwards.

Which one is faster depends on the shape, the cuBLAS build and the device, so nothing is assumed:
Gemv.tune measures, once per weight shape at warm-up, F.linear against a few tilings of the
kernel, as CUDA graph replays over every layer's weight of that shape (so the weights stream from
memory as in a step; one weight replayed alone would sit in the 50 MB L2), and keeps the kernel
only where it wins by a margin. Rows other than one, CPUs and shapes it lost on take F.linear.
On the H200 it took o, down and q/k/v of the 8B shape (the head in one lease of two; gate/up
stayed on cuBLAS), and with rope_write the step went from 5.58 to 4.97 ms (bench/RESULTS.md,
seventh pass).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from ddtree.engine.reference.fast import tree_attention
from ddtree.engine.reference.fast.rows import replay_us

log = logging.getLogger(__name__)

_MARGIN = 0.95  # the kernel must take at most this share of F.linear's time


@dataclass(frozen=True)
class Config:
    block_n: int   # output rows a program
    block_k: int   # inputs a step
    warps: int
    stages: int


# Tiles of 4 to 16 output rows by 256 to 1024 inputs, 16-byte loads along K for every thread. A
# program's loads in flight are its tile (plain loads are not pipelined across steps), and on an
# H200 the widest tile tried first (512) won on every 8B shape (bench/RESULTS.md, seventh pass),
# so 1024 is tried too; 16 x 1024 takes 8 warps to keep its float32 partial sums in registers.
CONFIGS = (Config(4, 512, 4, 2), Config(4, 1024, 4, 2), Config(8, 512, 4, 2), Config(8, 1024, 4, 2),
           Config(16, 256, 4, 2), Config(16, 512, 4, 2), Config(16, 1024, 8, 2))


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: Config) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] in x's dtype, with this tiling."""
    from ddtree.engine.reference.fast.triton_gemv import gemv

    n, k = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x = x.reshape(-1).contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    even = n % config.block_n == 0 and k % config.block_k == 0
    gemv[(-(-n // config.block_n),)](x, weight, bias if bias is not None else x, out, n, k, weight.stride(0),
                                     HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                     EVEN=even, num_warps=config.warps, num_stages=config.stages)
    return out


@torch.library.custom_op("ddtree::gemv", mutates_args=())
def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int, block_k: int,
          warps: int, stages: int) -> torch.Tensor:
    return launch(x, weight, bias, Config(block_n, block_k, warps, stages))


@_gemv.register_fake
def _(x, weight, bias, block_n, block_k, warps, stages):
    return x.new_empty((1, weight.shape[0]))


class Gemv:
    """linear(x, weight, bias): the kernel, with the tiling `tune` picked for this weight shape,
    when x is one row; else F.linear. `picked` is filled before any graph capture or compile
    trace, and only read after (a compiled layer guards on it)."""

    def __init__(self) -> None:
        self.picked: dict[tuple[int, int], Config] = {}
        self.measured: dict[tuple[int, int], dict[str, float]] = {}
        self.enabled = True  # False: F.linear runs every product and tune measures nothing (benchmarks)

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> Config | None:
        """The tiling this product runs with, or None for F.linear. Only tune fills `picked`, and
        only on CUDA (tests fill it by hand under Triton's interpreter)."""
        if self.enabled and self.picked and x.dim() == 2 and x.shape[0] == 1:
            return self.picked.get((int(weight.shape[0]), int(weight.shape[1])))
        return None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        config = self.takes(x, weight)
        if config is not None:
            return torch.ops.ddtree.gemv(x, weight, bias, config.block_n, config.block_k, config.warps, config.stages)
        return F.linear(x, weight, bias)

    def tune(self, groups: Iterable[list[tuple[torch.Tensor, Optional[torch.Tensor]]]],
             configs: tuple[Config, ...] = CONFIGS) -> None:
        """groups: the (weight, bias) pairs of one shape each (every layer's). Times F.linear and
        each tiling over a whole group, for shapes not yet measured. A no-op off CUDA, without
        triton, and inside a capture."""
        for group in groups:
            weight = group[0][0]
            key = (int(weight.shape[0]), int(weight.shape[1]))
            if (not self.enabled or key in self.measured or weight.device.type != "cuda" or not tree_attention.available()
                    or torch.cuda.is_current_stream_capturing()):
                continue
            x = torch.randn((1, key[1]), device=weight.device, dtype=weight.dtype)
            times = {"F.linear": replay_us(lambda: [F.linear(x, w, b) for w, b in group], weight.device, 1)}
            for config in configs:
                times[str(config)] = replay_us(lambda: [launch(x, w, b, config) for w, b in group], weight.device, 1)
            best = min(configs, key=lambda c: times[str(c)])
            self.measured[key] = {name: round(us / len(group), 2) for name, us in times.items()}
            if times[str(best)] <= _MARGIN * times["F.linear"]:
                self.picked[key] = best
            log.info("one-row linear %s (us a product): F.linear %.2f, best kernel %s %.2f -> %s", key,
                     self.measured[key]["F.linear"], best, self.measured[key][str(best)],
                     "kernel" if key in self.picked else "F.linear")
