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

On the kernel a product also folds in what DecoderLayer does around it: the RMSNorm before q/k/v
and gate/up, silu(gate) * up before down, the residual add after o and down. Each fold saves a
launch, so the tune times each shape with its folds on both sides (`plain`'s torch ops against
the kernel), as a step runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from ddtree.engine.reference.fast import row_ops, tree_attention
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


@dataclass(frozen=True)
class RowsConfig:
    """A tiling of the few-row kernel (triton_gemv.rows): a program's rows, outputs and inputs a step."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 2
    fma: bool = False  # triton_gemv.rows_fma (elementwise products, no tl.dot), for float32


# Few-row products: 2..ROWS_MAX rows (a one-session verify's query buckets, the drafter's block).
ROWS_MAX = 128
# Tiles tried for m rows, each at a program of 16 rows and of the power of two that covers m (at
# most 64). Few, because each is a Triton compile at warm-up per fold combination. On an H200
# cuBLAS ran most float32 products of 8-32 rows by 256 inputs at 6-8 us, some at 31-52
# (bench/results/h200-small-gemm-f32.json), and a demo verify's 65-row ones at 4-7 (bench/
# RESULTS.md), where a one-row GEMV took 2-2.5.
ROWS_TILES = ((16, 64, 4), (32, 64, 4), (64, 32, 4))
# Wider tiles with deeper pipelines (outputs, inputs a step, warps, stages), for 2-byte weights at
# a verify's 33+ rows, on the covering row tile only: on an H100, at the Qwen3-8B layer's 65-row
# products in bf16, these came within 0-16% of cuBLAS (gate/up tied it) where ROWS_TILES took
# 1.6-3.1x its time (bench/RESULTS.md; bench_rows_tiles.py). Tried only when Gemv.wide_rows is
# on: not yet measured with the folds or through a round.
WIDE_TILES = ((128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 8, 3))
WIDE_MIN_ROWS = 33
# Tiles of the elementwise kernel (rows, outputs, inputs a step, warps), for 4-byte weights: the
# demo pair's float32 verify and drafter products, where every tiling of tl.dot (16+ rows by 16+
# outputs) and cuBLAS took 7-23 us a product at 2-33 rows by 256-768 inputs on an H100, several
# times a one-row GEMV's 2. Each keeps 8192 float32 partial sums a program (64 a thread at 4
# warps); wide K steps, since a program's plain loads wait step by step. Measured on an H100
# (bench/RESULTS.md): at 17 rows the demo target's down product went from 21.8 to 5.2 us, o from
# 8.3 to 3.5, q/k/v from 9.5 to 4.8; gate/up and the head stayed on cuBLAS.
FMA_TILES = ((4, 8, 256, 4), (8, 4, 256, 4), (8, 8, 128, 4), (4, 4, 512, 4))


def rows_configs(m: int, wide: bool = False, fma: bool = False) -> tuple[RowsConfig, ...]:
    """The tilings the tune tries for m rows (wide: WIDE_TILES too, from WIDE_MIN_ROWS rows;
    fma: FMA_TILES too)."""
    cover = 16
    while cover < min(m, 64):
        cover *= 2
    configs = tuple(RowsConfig(bm, bn, bk, w) for bm in sorted({16, cover}) for bn, bk, w in ROWS_TILES)
    if wide and m >= WIDE_MIN_ROWS:
        configs += tuple(RowsConfig(cover, bn, bk, w, st) for bn, bk, w, st in WIDE_TILES)
    if fma:
        configs += tuple(RowsConfig(bm, bn, bk, w, fma=True) for bm, bn, bk, w in FMA_TILES)
    return configs


# What a product may fold in before it (Gemv's `pre`): the op's code in the kernel (PRE).
_SILU, _RMS = 1, 2


def plain(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pre=None,
          residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What Gemv computes, in torch ops: linear(pre(x)) (+ residual). pre: None; an RMSNorm
    module (x normed by it); or "silu" (x is the fused [gate; up], and silu(gate) * up is the
    product's input). The layers call this where no Gemv is set, and Gemv where it takes F.linear."""
    out = F.linear(_before(x, pre), weight, bias)
    return out if residual is None else residual + out


def _before(x: torch.Tensor, pre) -> torch.Tensor:
    """`pre` applied to x in torch ops (see plain)."""
    if isinstance(pre, str):
        gate, up = x.chunk(2, dim=-1)
        return ACTIVATIONS[pre](gate) * up
    return x if pre is None else pre(x)


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: Config, pre: int = 0,
           residual: Optional[torch.Tensor] = None, norm: Optional[torch.Tensor] = None,
           eps: float = 0.0) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] in x's dtype, with this tiling. pre: 0, or
    _SILU (x [1, 2K] is [gate; up]) or _RMS (x normed with weight `norm` and eps) folded into
    the product; residual [1, N]: added to it."""
    from ddtree.engine.reference.fast.triton_gemv import gemv

    n, k = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x = x.reshape(-1).contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    even = n % config.block_n == 0 and k % config.block_k == 0
    gemv[(-(-n // config.block_n),)](x, weight, bias if bias is not None else x, out,
                                     residual.reshape(-1).contiguous() if residual is not None else x,
                                     norm if norm is not None else x, n, k, weight.stride(0), float(eps),
                                     HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                     EVEN=even, PRE=pre, HAS_RES=residual is not None,
                                     num_warps=config.warps, num_stages=config.stages)
    return out


def launch_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: RowsConfig,
                pre: int = 0, residual: Optional[torch.Tensor] = None, norm: Optional[torch.Tensor] = None,
                eps: float = 0.0) -> torch.Tensor:
    """x [m, K] (or [m, 2K] with _SILU) @ weight[N, K]^T (+ bias) (+ residual [m, N]) -> [m, N]
    in x's dtype, on the few-row kernel with this tiling (config.fma: the elementwise one);
    pre as `launch`'s."""
    from ddtree.engine.reference.fast.triton_gemv import rows, rows_fma

    n, k = weight.shape
    m = x.shape[0]
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # Row tiles first: the programs that share a weight tile run side by side, so all but the
    # first read it from L2. Outputs first, a 65-row verify on 64-row tiles read an 8B layer's
    # weights from memory twice (each pass outgrows L2).
    grid = (-(-m // config.block_m), -(-n // config.block_n))
    # The elementwise kernel is float32 whatever x is; tl.dot's is exact float32 where x is.
    kernel, dot = (rows_fma, {}) if config.fma else (rows, {"IEEE": x.dtype == torch.float32 or x.device.type == "cpu"})
    kernel[grid](x, weight, bias if bias is not None else x, out,
                 residual.contiguous() if residual is not None else x, norm if norm is not None else x,
                 m, n, k, x.stride(0), weight.stride(0), float(eps), HAS_BIAS=bias is not None,
                 BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, PRE=pre,
                 HAS_RES=residual is not None, num_warps=config.warps, num_stages=config.stages, **dot)
    return out


@torch.library.custom_op("ddtree::gemm_rows", mutates_args=())
def _gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
               norm: Optional[torch.Tensor], eps: float, pre: int, block_m: int, block_n: int, block_k: int,
               warps: int, stages: int, fma: bool = False) -> torch.Tensor:
    return launch_rows(x, weight, bias, RowsConfig(block_m, block_n, block_k, warps, stages, fma), pre, residual,
                       norm, eps)


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: RowsConfig, pre: int = 0,
              residual: Optional[torch.Tensor] = None, norm: Optional[torch.Tensor] = None,
              eps: float = 0.0) -> torch.Tensor:
    """launch_rows through its custom op (what a compiled layer calls as it is)."""
    return torch.ops.ddtree.gemm_rows(x, weight, bias, residual, norm, eps, pre, config.block_m, config.block_n,
                                      config.block_k, config.warps, config.stages, config.fma)


@_gemm_rows.register_fake
def _(x, weight, bias, residual, norm, eps, pre, block_m, block_n, block_k, warps, stages, fma=False):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("ddtree::gemv", mutates_args=())
def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
          norm: Optional[torch.Tensor], eps: float, pre: int, block_n: int, block_k: int, warps: int,
          stages: int) -> torch.Tensor:
    return launch(x, weight, bias, Config(block_n, block_k, warps, stages), pre, residual, norm, eps)


@_gemv.register_fake
def _(x, weight, bias, residual, norm, eps, pre, block_n, block_k, warps, stages):
    return x.new_empty((1, weight.shape[0]))


def _fold_args(pre) -> tuple[int, Optional[torch.Tensor], float]:
    """The kernel's PRE code, norm weight and eps for `pre` (one Gemv.takes accepts)."""
    if pre is None:
        return 0, None, 0.0
    if pre == "silu":
        return _SILU, None, 0.0
    return _RMS, pre.weight, float(pre.eps)


def _foldable(pre) -> bool:
    """Whether the kernel's prologue computes `pre`: nothing, silu, or model.RMSNorm (weight,
    eps), not another activation, a LayerNorm (mean and bias) nor a norm without a weight."""
    if pre is None or pre == "silu":
        return True
    if isinstance(pre, str):
        return False
    from ddtree.engine.reference.fast.model import RMSNorm

    return isinstance(pre, RMSNorm) and pre.weight is not None


def _tunable(weight: torch.Tensor) -> bool:
    """Whether a tune can time kernels for this weight: on CUDA, with triton, outside a capture."""
    return (weight.device.type == "cuda" and tree_attention.available()
            and not torch.cuda.is_current_stream_capturing())


class Gemv:
    """linear(x, weight, bias): the kernel, with the tiling `tune` picked for this weight shape,
    when x is one row; else, in bf16/fp16 on CUDA outside a compile, F.linear with row_ops
    around it (fewer launches for the norm, silu and residual add); else `plain`. `picked` is
    filled before any graph capture or compile trace, and only read after (a compiled layer
    guards on it)."""

    def __init__(self) -> None:
        self.picked: dict[tuple[int, int], Config] = {}
        self.measured: dict[tuple[int, int], dict[str, float]] = {}
        # Few-row products, keyed (rows, N, K): filled by tune_rows, like `picked`.
        self.picked_rows: dict[tuple[int, int, int], RowsConfig] = {}
        self.measured_rows: dict[tuple[int, int, int], dict[str, float]] = {}
        # True: tune_rows measures the few-row kernel, and picks it where it beats cuBLAS. On an
        # H200 it took the demo's 9-row float32 verify from 0.98 to 0.55 ms (cuBLAS picked a slow
        # kernel); elsewhere its gain was within run-to-run spread. Its CUDA tests pass
        # (bench/RESULTS.md). False is cuBLAS alone (benchmarks).
        self.rows = True
        # True: tune_rows tries WIDE_TILES too, for 2-byte weights (bf16/fp16). Off until measured
        # through a round (profile_round.py --wide-rows).
        self.wide_rows = False
        # True: tune_rows tries FMA_TILES too, for 4-byte weights (the demo pair's float32): on an
        # H100 that took the demo's DDTree-32 round from 1.08 to 0.82 ms. False: without them (A/B).
        self.fma_rows = True
        self.enabled = True  # False: F.linear runs every product and tune measures nothing (benchmarks)
        # False: norm, activation and residual run as torch ops around every product, one row (the
        # kernel) or many (row_ops) (benchmarks).
        self.folds = True

    def takes(self, x: torch.Tensor, weight: torch.Tensor, pre=None) -> Config | RowsConfig | None:
        """The tiling this product runs with: a Config (one row, the GEMV kernel), a RowsConfig
        (2..ROWS_MAX rows, the few-row kernel), or None for torch ops (`plain`). Only the tunes
        fill `picked` and `picked_rows`, and only on CUDA (tests fill them by hand under Triton's
        interpreter). Of the activations only silu folds into the kernels."""
        if not (self.enabled and (self.picked or self.picked_rows) and x.dim() == 2):
            return None
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        # Compare, not int(): inside a compile trace int() would pin the row count, one compiled
        # layer per query bucket where the many-row buckets share one.
        if x.shape[0] == 1:
            config = self.picked.get(shape)
        elif self.picked_rows:
            config = self.picked_rows.get((int(x.shape[0]), *shape))
        else:
            return None
        return config if config is not None and _foldable(pre) else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pre=None,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`plain`'s product, norm or activation before it and residual after it, on the kernel
        where `takes` says so: one launch where torch ops take two or three."""
        config = self.takes(x, weight, pre)
        if config is None:
            if self.enabled and self.folds and row_ops.runs(x):  # runs() asks is_compiling first
                return row_ops.linear(x, weight, bias, pre, residual, _before)
            return plain(x, weight, bias, pre, residual)
        if not self.folds and (pre is not None or residual is not None):
            out = self(_before(x, pre), weight, bias)
            return out if residual is None else residual + out
        code, norm, eps = _fold_args(pre)
        if isinstance(config, RowsConfig):
            return gemm_rows(x, weight, bias, config, code, residual, norm, eps)
        return torch.ops.ddtree.gemv(x, weight, bias, residual, norm, eps, code, config.block_n, config.block_k,
                                     config.warps, config.stages)

    def tune(self, groups: Iterable[list[tuple[torch.Tensor, Optional[torch.Tensor]]]],
             configs: tuple[Config, ...] = CONFIGS, folds: Optional[list] = None) -> None:
        """groups: the (weight, bias) pairs of one shape each (every layer's). folds: per group,
        None or (pre, residual): what the layers fold into that product (pre as `plain` takes
        it, residual True for a residual add). Times the torch ops (F.linear, with the folded
        ops around it: "torch ops") and each tiling over a whole group, for shapes not yet
        measured: a fold saves torch a launch, so both sides run what a step runs. The torch
        side runs eagerly, where a compiled step fuses silu and its product into one kernel, so
        down's fold is credited a launch more than it saves. Shapes are keyed alone: two groups
        of one shape share the first one's timing. A no-op off CUDA, without triton, and inside
        a capture."""
        for i, group in enumerate(groups):
            weight = group[0][0]
            key = (int(weight.shape[0]), int(weight.shape[1]))
            if not self.enabled or key in self.measured or not _tunable(weight):
                continue
            pre, residual = folds[i] if folds is not None and folds[i] is not None and self.folds else (None, False)
            if not _foldable(pre):
                pre = None  # an op the kernel does not fold: the product alone is what differs
            x = torch.randn((1, key[1] * (2 if pre == "silu" else 1)), device=weight.device, dtype=weight.dtype)
            res = torch.randn((1, key[0]), device=weight.device, dtype=weight.dtype) if residual else None
            code, norm, eps = _fold_args(pre)
            base = "F.linear" if pre is None and res is None else "torch ops"
            times = {base: replay_us(lambda: [plain(x, w, b, pre, res) for w, b in group], weight.device, 1)}
            for config in configs:
                times[str(config)] = replay_us(lambda: [launch(x, w, b, config, code, res, norm, eps) for w, b in group],
                                               weight.device, 1)
            best = min(configs, key=lambda c: times[str(c)])
            self.measured[key] = {name: round(us / len(group), 2) for name, us in times.items()}
            if times[str(best)] <= _MARGIN * times[base]:
                self.picked[key] = best
            log.info("one-row linear %s (us a product): %s %.2f, best kernel %s %.2f -> %s", key, base,
                     self.measured[key][base], best, self.measured[key][str(best)],
                     "kernel" if key in self.picked else "torch")

    def tune_rows(self, groups: Iterable[list[tuple[torch.Tensor, Optional[torch.Tensor]]]], rows: Iterable[int],
                  folds: Optional[list] = None) -> None:
        """`tune` for few-row products: at each row count in `rows` (2..ROWS_MAX; others are
        skipped), the torch ops against rows_configs(m) of the few-row kernel, over each whole
        group, keeping the kernel for (m, N, K) where it takes at most _MARGIN of the torch ops'
        time. The same no-ops as `tune`."""
        counts = sorted({int(m) for m in rows if 2 <= int(m) <= ROWS_MAX})
        for i, group in enumerate(groups):
            weight = group[0][0]
            shape = (int(weight.shape[0]), int(weight.shape[1]))
            if not (self.enabled and self.rows) or not _tunable(weight):
                continue
            pre, residual = folds[i] if folds is not None and folds[i] is not None and self.folds else (None, False)
            if not _foldable(pre):
                pre = None
            code, norm, eps = _fold_args(pre)
            base = "F.linear" if pre is None and not residual else "torch ops"
            done = {}
            for m in counts:
                key = (m, *shape)
                if key in self.measured_rows:  # a group of the same shape measured it (as `tune`)
                    continue
                x = torch.randn((m, shape[1] * (2 if pre == "silu" else 1)), device=weight.device, dtype=weight.dtype)
                res = torch.randn((m, shape[0]), device=weight.device, dtype=weight.dtype) if residual else None
                times = {base: replay_us(lambda: [plain(x, w, b, pre, res) for w, b in group], weight.device, 1)}
                configs = rows_configs(m, wide=self.wide_rows and weight.element_size() == 2,
                                       fma=self.fma_rows and weight.element_size() == 4)
                for config in configs:
                    try:
                        times[str(config)] = replay_us(
                            lambda: [launch_rows(x, w, b, config, code, res, norm, eps) for w, b in group],
                            weight.device, 1)
                    except Exception as exc:  # noqa: BLE001 - a tiling past this GPU's shared memory
                        # fails in Triton's compile, in replay_us's warm-up before any capture: skip it.
                        log.info("few-row tiling %s does not run at %s: %s", config, key, str(exc)[:120])
                configs = [c for c in configs if str(c) in times]
                if not configs:
                    self.measured_rows[key] = {base: round(times[base] / len(group), 2)}
                    continue
                best = min(configs, key=lambda c: times[str(c)])
                self.measured_rows[key] = {name: round(us / len(group), 2) for name, us in times.items()}
                if times[str(best)] <= _MARGIN * times[base]:
                    self.picked_rows[key] = best
                done[m] = (self.measured_rows[key][base], self.measured_rows[key][str(best)])
            if done:
                log.info("few-row linears %s (rows: us a product, %s / best kernel): %s", shape, base, done)
