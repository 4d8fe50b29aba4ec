"""Tree attention in one fused kernel (Triton): few new queries over a static KV cache.

What it computes, for each batch row b (one cache, or one pool slot) with n new rows already
written at cache rows [length_b, length_b + n): new row i sees every context row [0, length_b)
and new row j where tree[b, i, j] (every new row when tree is None: the drafter's block). Rows
past length_b + n are never read. The lengths are device values the kernel reads itself, so one
CUDA graph serves any context length and reads only the rows that exist.

Why a kernel of our own: the "matmul" kernel (model.py) needs a mask built per forward, writes
float32 scores [kv_heads, G*n, span], then runs a softmax and a second GEMM; on an H200 those
took about 0.75 ms of an 8.8 ms DDTree-64 round on the Qwen3-8B shape, and the fused SDPA kernels
give a few queries a handful of thread blocks for the whole cache. Measured on an H200
(bench/RESULTS.md, fifth pass): 1.5-5.8x faster per layer than the matmul kernel; in the engine,
a DDTree-64 round's attention went to about 0.5 ms, and the 8B AR step did not move. This is flash decoding:
programs of (batch row x kv head, query block, key split) stream their share of the key blocks
with an online softmax, and a second small kernel merges the splits. The G query heads of a kv
head are folded into its query rows, so K/V are read once per kv head.

Numerics are flash attention's: float32 scores and sums, the probabilities rounded to the value
dtype for the second product (the matmul kernel rounds them too, after normalising). In float32
the products are exact float32 ("ieee"), never tf32.

CUDA tensors run the compiled kernels. Under TRITON_INTERPRET=1 (set before triton is first
imported) CPU tensors run the same kernels in Triton's interpreter: slow, for the tests on a
machine without a GPU. `available()` says whether triton is installed.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from ddtree.engine.reference.errors import BadParams

MERGE_ROWS = 16    # query rows a program of the merge kernel combines
_MAX_SPLITS = 64
# From this many (batch row, kv head) pairs a launch takes default_config's batched tiling: 4
# rows of 8 kv heads. Measured at b=4, 8 and 16 (it won at each); b=1 keeps the one-row fit, which
# beat it there; b=2 was not measured. Only up to BATCHED_ROWS query rows per kv head (17 nodes of
# 4 query heads a kv head), as measured: on one row the same tiling lost at 65 nodes and more.
BATCHED_PAIRS = 32
BATCHED_ROWS = 68
# The cache the default tiling was fitted on (8256 rows, an 8k window and its slack), where
# min_blocks=8 gives an AR step 9 splits. A smaller cache plans its splits for these rows:
# planned on its own, a 1,664-row cache gave an AR step 2 splits (16 programs for the whole GPU),
# 13.1 us a layer at a 1k context against 9.1 (H200, bench/RESULTS.md, eighth pass). A larger
# cache uses the fitted count until the context needs more (_per_split in triton_kernels.py): at
# 33 splits, what a 40k window plans, the 8B AR step's attention took 18.7 us a layer at a 4k
# context against 15.0 with the fitted 9 (both measured in an 8256-row cache).
_PLAN_ROWS = 8256


@functools.cache
def available() -> bool:
    """Whether triton is installed (it comes with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def supported(head_dim: int) -> bool:
    """Whether the kernels take this head size (a power of two, as tl.arange needs, 16..256)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def _kernels(device: torch.device):
    from ddtree.engine.reference.fast import triton_kernels as k

    if device.type != "cuda" and not interpreting():
        raise BadParams("tree attention runs on CUDA, or on a CPU in Triton's interpreter",
                        "set TRITON_INTERPRET=1 before triton is first imported")
    return k.attend_split, k.merge_splits


def runs(device: torch.device, head_dim: int) -> bool:
    """Whether the kernels run for this device and head size: CUDA with triton installed, or a
    CPU under Triton's interpreter (tests)."""
    if not (available() and supported(head_dim)):
        return False
    return device.type == "cuda" or interpreting()


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1 when triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    from ddtree.engine.reference.fast import triton_kernels as k

    return isinstance(k.attend_split, InterpretedFunction)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Config:
    """How a launch tiles the work: query rows and key rows a step (block_m, block_n), warps and
    pipeline stages a program, and the fewest key blocks a split takes (min_blocks)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    min_blocks: int


def default_config(rows_per_kv: int, dtype: torch.dtype, pairs: int = 1) -> Config:
    """The tiling for this many query rows per kv head (groups * n), dtype, and (batch row, kv
    head) pairs: the rule that came within 8% of the best tiling (geometric mean, 25% at worst)
    over the 24 cases of an H200 sweep of one batch row (bench_tree_attention.py --sweep: Qwen3-8B
    and 1.7B attention in bf16, the demo target's in float32, 1 to 257 nodes, 1k and 4k contexts;
    bench/RESULTS.md). A batched round of BATCHED_PAIRS pairs or more, of up to BATCHED_ROWS rows
    (an AR step, a DFlash block, a DDTree-16 tree at Qwen3-8B's 4 query heads a kv head), takes
    shorter key blocks and a deeper pipeline: at b=16 it came within 0.5% of the sweep's best in
    all 8 bf16 cases (1.7B and 8B, 1 and 17 nodes, 512 and 1k contexts), 16-37% faster than the
    one-row rule; at b=4 and 8, within 8% of the best, 16-25% faster (the 8B shape at 17 nodes,
    b=4, did not run). Contexts past 1k were not measured."""
    if dtype == torch.float32:  # exact float32 products run on the FMA units: small tiles
        return Config(block_m=16 if rows_per_kv <= 256 else 32, block_n=64, warps=4, stages=2, min_blocks=8)
    if pairs >= BATCHED_PAIRS and rows_per_kv <= BATCHED_ROWS:
        return Config(block_m=16 if rows_per_kv <= 16 else 64, block_n=32, warps=4, stages=3, min_blocks=8)
    block_m = 16 if rows_per_kv <= 16 else 32 if rows_per_kv <= 128 else 64
    return Config(block_m=block_m, block_n=128, warps=4, stages=2, min_blocks=8)


def plan_splits(pairs: int, row_blocks: int, max_rows: int, device: torch.device, block_n: int,
                min_blocks: int) -> int:
    """How many key splits at most: about two programs per multiprocessor, at least min_blocks
    key blocks a split at max_rows (or _PLAN_ROWS, if more), at most _MAX_SPLITS. A shorter
    context spreads its blocks over fewer splits (the kernels divide by the length they read), so
    one launch, and one CUDA graph, serves every length. On a CPU (the interpreter) a few, so
    tests cover the merge."""
    if device.type != "cuda":
        return max(1, min(3, -(-max_rows // block_n)))
    blocks = -(-max(max_rows, _PLAN_ROWS) // block_n)
    wanted = -(-2 * _multiprocessors(device.index or 0) // (pairs * row_blocks))
    return max(1, min(wanted, -(-blocks // min_blocks), _MAX_SPLITS))


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                   tree: Optional[torch.Tensor], scale: float, max_rows: int,
                   slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B*n, heads, d] (batch-row major); keys/values [B, kv_heads, rows, d] with the new rows
    written; lengths [B] long (context rows per batch row, on the device); tree None or bool
    [B, n, n] (visibility among the new rows); max_rows: the most rows any batch row may attend
    (length + n), which sizes the key splits -> [B*n, heads, d] in q's dtype. slots: [B] long on
    the device, the cache slot each batch row reads (keys/values then hold every slot, and B is
    slots' length); None reads slots 0..B-1. A custom op, so torch.compile'd code calls it as it is."""
    return torch.ops.ddtree.tree_attention(q, keys, values, lengths, tree, scale, max_rows, slots)


@torch.library.custom_op("ddtree::tree_attention", mutates_args=())
def _tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                    tree: Optional[torch.Tensor], scale: float, max_rows: int,
                    slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    return launch(q, keys, values, lengths, tree, scale, max_rows, slots=slots)


def launch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
           tree: Optional[torch.Tensor], scale: float, max_rows: int, config: Config | None = None,
           splits: int | None = None, fitted: int | None = None, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """tree_attention's kernels launched directly, with this tiling (default_config when None):
    what the op runs, and what bench_tree_attention.py tunes. splits: the launch's key splits
    (plan_splits for max_rows when None); fitted: the splits a short context uses (plan_splits
    for _PLAN_ROWS when None and splits are planned, else all of `splits`)."""
    batch, kv_heads, _, d = keys.shape
    if slots is not None:
        batch = slots.shape[0]
    heads = q.shape[1]
    n = q.shape[0] // batch
    groups = heads // kv_heads
    rows_per_kv = groups * n
    config = config or default_config(rows_per_kv, q.dtype, batch * kv_heads)
    block_n = config.block_n
    out = torch.empty((batch * n, heads, d), dtype=q.dtype, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    row_blocks = -(-rows_per_kv // config.block_m)
    pairs = batch * kv_heads
    if splits is None:
        splits = plan_splits(pairs, row_blocks, max_rows, q.device, block_n, config.min_blocks)
        if fitted is None:
            fitted = plan_splits(pairs, row_blocks, _PLAN_ROWS, q.device, block_n, config.min_blocks)
    fitted = max(1, min(splits, fitted if fitted is not None else splits))
    attend, merge = _kernels(q.device)
    if tree is not None:
        tree = tree.view(torch.uint8)
        st_b, st_i = tree.stride(0), tree.stride(1)
    else:
        st_b = st_i = 0
    final = splits == 1
    part = out if final else torch.empty((splits, pairs, rows_per_kv, d), dtype=torch.float32, device=q.device)
    ml = out if final else torch.empty((2, splits, pairs, rows_per_kv), dtype=torch.float32, device=q.device)
    attend[(pairs, row_blocks, splits)](
        q, keys, values, lengths, tree if tree is not None else lengths, slots if slots is not None else lengths,
        out, part, ml,
        n, rows_per_kv, kv_heads, groups, splits, fitted, config.min_blocks, float(scale), 0 if final else ml.stride(0),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), st_b, st_i, out.stride(0), out.stride(1),
        0 if final else part.stride(0), 0 if final else part.stride(1), 0 if final else part.stride(2),
        0 if final else ml.stride(1), 0 if final else ml.stride(2),
        D=d, BLOCK_M=config.block_m, BLOCK_N=block_n, HAS_TREE=tree is not None, HAS_SLOTS=slots is not None,
        IEEE=q.dtype == torch.float32 or q.device.type != "cuda", FINAL=final,
        num_warps=config.warps, num_stages=config.stages)
    if not final:
        merge[(pairs, -(-rows_per_kv // MERGE_ROWS))](
            part, ml, out, lengths, n, rows_per_kv, kv_heads, groups, splits, fitted, config.min_blocks, ml.stride(0),
            out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
            ml.stride(1), ml.stride(2), D=d, BLOCK_R=MERGE_ROWS, BLOCK_N=block_n, num_warps=4)
    return out


@_tree_attention.register_fake
def _(q, keys, values, lengths, tree, scale, max_rows, slots=None):
    return q.new_empty((q.shape[0], q.shape[1], keys.shape[3]))
