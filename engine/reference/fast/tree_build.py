"""Draft trees built in one kernel (Triton): the whole of batch_tree.build_trees_device after the
vocabulary's top-k, for every batch row at once.

What it computes is exactly build_trees_device's tree (batch_tree.py, and tree.py's
build_tree_device_scored for why the steps are exact): beam by depth over the candidate pairs of
tree._layout, then the n best over all depths with ties to the earlier layout index, the kept
nodes in layout order, and the ancestor matrix. One program builds one row's tree: it sorts each
depth's candidates (about M ln M of them) as int64 keys of (score, index), so its beams are
sorted best first, and its ties go to the earlier candidate where torch.topk leaves them open.

Why a kernel: on an H200 the torch steps took 15 topk calls (gatherTopK and radixSort, 20-37 us
each) plus the layout's gathers: about 0.6 ms of a 12.9 ms DDTree-256 round on the Qwen3-8B shape,
and 0.37 ms of a 1.4 ms DDTree-32 round on the demo pair. With the kernel the tree stage took
0.225 ms at budget 256 on the 8B shape (random weights: a flat draft, which pruning cuts to
depth 1) and 0.088 ms at 32 on the demo pair (trained) (bench/RESULTS.md,
sixth pass). Sorting every candidate in one program is slow at budget 256 (0.64 ms on the 8B
shape), so the kernel first drops candidates that cannot make the tree (triton_tree.build_tree
says why that changes nothing) and sorts the rest narrow.
"""

from __future__ import annotations

import functools
import torch

from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast import tree_attention
from ddtree.engine.reference.tree import _layout, _pairs_within, beam_widths

# The widest sort a program takes (keys in registers): budget 256 over 15 depths. Wider trees use
# the torch steps: on an H200 with a trained-like (peaked) draft, whose deep beams survive
# pruning, the kernel took 1628 us at budget 512 against 905 for the torch steps, and 657
# against 764 at 256 (bench/RESULTS.md, seventh pass). It compiles up to 8192 (the CPU test).
_MAX_SORT = 4096


@functools.cache
def _sizes(budget: int, k: int, depth_count: int) -> tuple[int, int]:
    """Host ints of a build's layout: the most candidate pairs any depth scores, and the layout
    size (the root and every depth's beam)."""
    widths = beam_widths(budget, k, depth_count)
    pairs = _pairs_within(budget, k)
    return max((pairs[w - 1] for w in widths[:-1]), default=0), 1 + sum(widths)


def _pow2(x: int) -> int:
    """The power of two at or above x, at least 16 (tl.arange's sizes)."""
    return max(16, 1 << max(0, (x - 1).bit_length()))


def _fits(budget: int, k: int, depth_count: int) -> bool:
    return _pow2(max(_sizes(budget, k, depth_count))) <= _MAX_SORT


@functools.cache  # graphs read these by address: never evicted (the keys are few, as _layout's)
def _steps(budget: int, k: int, depth_count: int, device: torch.device) -> torch.Tensor:
    """[L, 2] int32 on the device: each depth's most beam nodes and its beam's first layout index."""
    widths = beam_widths(budget, k, depth_count)
    steps = torch.empty((depth_count, 2), dtype=torch.int32, device=device)
    start = 1
    for d, width in enumerate(widths):
        # Device fills, no host copy: a graph's warm-up may be the first to ask.
        steps[d, 0].fill_(width)
        steps[d, 1].fill_(start)
        start += width
    return steps


def runs(logprobs: torch.Tensor, budget: int) -> bool:
    """Whether the kernel builds this tree in production: float32 log-probs [b, L, V] on CUDA with
    triton installed (its scores add in float32, as the torch steps do for float32), and a budget
    whose sorts fit a program. (Tests also run it on a CPU in Triton's interpreter.)"""
    return (logprobs.is_cuda and tree_attention.available() and logprobs.dim() == 3
            and logprobs.dtype == torch.float32 and 0 < budget
            and _fits(budget, min(budget, logprobs.shape[2]), logprobs.shape[1]))


def build(roots: torch.Tensor, logprobs: torch.Tensor, budget: int):
    """roots [b] long, logprobs [b, L, V] (L, V, budget >= 1) -> (tokens, depths, parents [b, n]
    long, visible [b, n, n] bool, scores [b, n] float32), n = 1 + min(budget, prefixes)."""
    b, depth_count, vocab = logprobs.shape
    device = logprobs.device
    if device.type != "cuda" and not tree_attention.interpreting():
        raise BadParams("the tree kernel runs on CUDA, or on a CPU in Triton's interpreter",
                        "set TRITON_INTERPRET=1 before triton is first imported")
    k = min(budget, vocab)
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1)          # [b, L, k], best first
    if not _fits(budget, k, depth_count):
        raise BadParams(f"a tree of budget {budget} over {depth_count} depths is too wide for the kernel")
    layout = _layout(budget, k, depth_count, device)
    candidates, total = _sizes(budget, k, depth_count)
    n = 1 + min(budget, total - 1)
    pc, pt, pn = _pow2(candidates), _pow2(total), _pow2(n)
    score_scratch = torch.empty((b, total), dtype=torch.float32, device=device)
    parent_scratch = torch.empty((b, total), dtype=torch.int32, device=device)
    token_scratch = torch.empty((b, total), dtype=torch.long, device=device)
    slot_scratch = torch.empty((b, total), dtype=torch.int32, device=device)
    key_scratch = torch.empty((b, max(pc, pt)), dtype=torch.long, device=device)
    tokens = torch.empty((b, n), dtype=torch.long, device=device)
    depths = torch.empty((b, n), dtype=torch.long, device=device)
    parents = torch.empty((b, n), dtype=torch.long, device=device)
    scores = torch.empty((b, n), dtype=torch.float32, device=device)
    visible = torch.zeros((b, n, n), dtype=torch.bool, device=device)
    roots = roots.to(device=device, dtype=torch.long).contiguous()
    from ddtree.engine.reference.fast.triton_tree import build_tree

    build_tree[(b,)](
        top_vals, top_ids, roots, _steps(budget, k, depth_count, device), layout.rows, layout.cols, layout.depths,
        score_scratch, parent_scratch, token_scratch, slot_scratch, key_scratch,
        tokens, depths, parents, scores, visible.view(torch.uint8),
        depth_count, k, budget, total, n, min(depth_count, n - 1),
        top_vals.stride(0), top_vals.stride(1), top_ids.stride(0), top_ids.stride(1),
        score_scratch.stride(0), key_scratch.stride(0), tokens.stride(0), visible.stride(0), visible.stride(1),
        PK=_pow2(k), PM=_pow2(budget), PC=pc, PS=min(pc, _pow2(budget)), PT=pt, PF=min(pt, 2 * pn), PN=pn,
        num_warps=4 if max(pc, pt) < 2048 else 8 if max(pc, pt) < 8192 else 16)
    return tokens, depths, parents, visible, scores
