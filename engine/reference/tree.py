"""Draft trees: best-first construction, the ancestor mask, and the walk.

Node 0 is the root (the bonus token, already committed); nodes 1..M are draft tokens in the order
the best-first search produced them (build_tree) or in depth-major order (build_tree_device); both
put every parent before its children.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass

import torch

from ddtree.engine.reference.errors import BadParams


@dataclass
class Tree:
    tokens: torch.Tensor    # [1+M] long, tokens[0] = root token
    depths: torch.Tensor    # [1+M] long, depths[0] = 0
    parents: torch.Tensor   # [1+M] long, parents[0] = 0 (the root is its own parent)
    is_chain: bool          # node i's parent is i-1 for every i: a causal mask does the job
    max_depth: int
    _anc: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def ancestors(self) -> torch.Tensor:
        if self._anc is None:
            self._anc = ancestor_matrix(self.parents, self.max_depth)
        return self._anc


def build_tree(root: int, logprobs: torch.Tensor, budget: int) -> Tree:
    """The `budget` most probable prefixes under per-depth draft log-probs [L, V].

    Per depth only the top K = min(budget, V) tokens can be in the tree: a node of rank r at some
    depth needs r better siblings in the tree first, so rank >= budget is never reached.
    """
    device = logprobs.device
    depth_count, vocab = logprobs.shape
    k = min(budget, vocab)
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1)
    vals = top_vals.tolist()
    tokens = [root]
    depths = [0]
    parents = [0]
    scores = [0.0]
    # Heap entries: (-score, tie-break, depth, rank, parent node). Depth is 1-based.
    heap = [(-vals[0][0], 0, 1, 0, 0)]
    ranks: list[int] = [0]
    counter = 1
    while heap and len(tokens) <= budget:
        neg, _, depth, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        score = -neg
        tokens.append(-1)  # filled from top_ids below, in one gather
        depths.append(depth)
        parents.append(parent)
        scores.append(score)
        ranks.append(rank)
        if rank + 1 < k:
            heapq.heappush(heap, (-(scores[parent] + vals[depth - 1][rank + 1]), counter, depth, rank + 1, parent))
            counter += 1
        if depth < depth_count:
            heapq.heappush(heap, (-(score + vals[depth][0]), counter, depth + 1, 0, node))
            counter += 1
    depth_t = torch.tensor(depths, dtype=torch.long)
    rank_t = torch.tensor(ranks, dtype=torch.long)
    token_t = top_ids.cpu()[(depth_t[1:] - 1), rank_t[1:]]
    token_t = torch.cat((torch.tensor([root], dtype=torch.long), token_t))
    parent_t = torch.tensor(parents, dtype=torch.long)
    n = len(tokens)
    is_chain = bool(n == 1 or torch.equal(parent_t[1:], torch.arange(n - 1)))
    return Tree(token_t.to(device), depth_t.to(device), parent_t.to(device), is_chain, max(depths))


def chain_tree(root: int, draft_tokens: torch.Tensor) -> Tree:
    """A chain: root, then draft_tokens [L] one under the other (DFlash)."""
    device = draft_tokens.device
    n = draft_tokens.shape[0] + 1
    tokens = torch.cat((torch.tensor([root], dtype=torch.long, device=device), draft_tokens.long()))
    steps = torch.arange(n, device=device)
    return Tree(tokens, steps, (steps - 1).clamp(min=0), True, n - 1)


def root_tree(root: int, device: torch.device | str) -> Tree:
    """The bonus token alone: a round without a draft (AR, or no room left to draft)."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(torch.tensor([root], dtype=torch.long, device=device), zero, zero, True, 0)


def tree_scores(tree: Tree, logprobs: torch.Tensor) -> torch.Tensor:
    """Cumulative log-prob of each node's path (root 0); for tests and diagnostics."""
    anc = tree.ancestors()
    lp = torch.zeros(tree.size, dtype=logprobs.dtype, device=logprobs.device)
    lp[1:] = logprobs[tree.depths[1:] - 1, tree.tokens[1:]]
    return (anc.to(lp.dtype) * lp[None, :]).sum(-1)


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is true when j is i or one of i's ancestors.

    Pointer jumping: after step s each row holds the ancestors closer than 2**s and `up` points
    2**s levels up (the root points at itself), so ceil(log2(depth+1)) steps suffice.
    """
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = parents
    reach = 1
    while reach <= max_depth:
        anc = anc | anc[up]
        up = up[up]
        reach *= 2
    return anc


def tree_attention_mask(tree: Tree, context_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, n, context_len + n]: all context, plus exactly each node's ancestors."""
    n = tree.size
    anc = tree.ancestors()
    mask = torch.zeros((n, context_len + n), dtype=dtype, device=tree.tokens.device)
    mask[:, context_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return mask[None, None]


def accepted_path(tree: Tree, posterior: torch.Tensor) -> torch.Tensor:
    """Walk: indices of the accepted nodes, root first (ascending = root-to-leaf order).

    A node is accepted when every node on its path, itself included, carries the token the target
    chose at that node's parent. Siblings carry distinct tokens, so at most one child matches and
    the accepted nodes form a single path.
    """
    matched = tree.tokens == posterior[tree.parents]
    matched[0] = True
    if tree.is_chain:
        # cumprod stops at the first mismatch
        return torch.nonzero(matched.long().cumprod(0), as_tuple=True)[0]
    anc = tree.ancestors()
    ok = ~(anc & ~matched[None, :]).any(dim=1)
    return torch.nonzero(ok, as_tuple=True)[0]


# ---- device-side build and walk ---------------------------------------------------------------
# The GPU backend builds and walks trees without a host heap and without a host sync: every shape
# below follows from Python ints (budget, L, V) alone, never from tensor values, and nothing reads
# a tensor back to the host except fetch_walk, the one transfer a round is allowed.


def build_tree_device(root: int | torch.Tensor, logprobs: torch.Tensor, budget: int) -> Tree:
    """The `budget` most probable prefixes under log-probs [L, V], built on logprobs' device.

    Same node set (up to ties) as build_tree; see build_tree_device_scored for how and for the
    output layout. `root` may be an int or a one-element long tensor on logprobs' device.
    """
    return build_tree_device_scored(root, logprobs, budget)[0]


def build_tree_device_scored(root: int | torch.Tensor, logprobs: torch.Tensor,
                             budget: int) -> tuple[Tree, torch.Tensor]:
    """build_tree_device plus each node's cumulative log-prob [n] (root 0), for tests and diagnostics.

    Beam by depth: depth 1 keeps its top k = min(M, V) tokens; depth d extends the kept prefixes of
    depth d-1 by the top k tokens of depth d and keeps the best min(M, width*k). A depth-d prefix
    outside that beam is beaten by M kept ones, so the beams hold an optimal answer (most of the
    M*k extensions need no look: _candidate_pairs); the last step keeps the best M over all of
    them. Log-probs are clamped to <= 0, so a child never outscores
    its parent (float addition of a value <= 0 cannot round upward either), and a tie at the cut
    goes to the earlier node of the depth-major layout, which puts a parent before an equal child:
    the selection is closed under ancestors whatever the ties.

    Output: root first, then the kept nodes in depth-major order (parents before children), the
    ancestor matrix already built, and is_chain False (telling would take a sync; a chain still
    verifies correctly under its ancestor mask) except where the shapes alone force a chain
    (budget <= 1, or a vocab of 1). Node count is 1 + min(M, number of prefixes of length 1..L):
    a budget beyond the prefix space takes all of them. Scores add in logprobs' dtype.

    Float32 log-probs on CUDA go to one kernel (fast/tree_build.py) that builds this same tree,
    with a tie inside a depth's beam going to the earlier candidate.
    """
    if logprobs.dim() != 2:
        raise BadParams(f"logprobs must be [depth, vocab], got shape {tuple(logprobs.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise BadParams(f"tree budget must be an int >= 0, got {budget!r}")
    device = logprobs.device
    depth_count, vocab = logprobs.shape
    if isinstance(root, torch.Tensor):
        root_t = root.reshape(1).to(device=device, dtype=torch.long)
    else:
        root_t = torch.full((1,), root, dtype=torch.long, device=device)  # a fill, not a copy
    zero_l = torch.zeros(1, dtype=torch.long, device=device)
    zero_f = torch.zeros(1, dtype=logprobs.dtype, device=device)
    if budget == 0 or depth_count == 0 or vocab == 0:
        tree = Tree(root_t, zero_l, zero_l, True, 0, torch.ones((1, 1), dtype=torch.bool, device=device))
        return tree, zero_f

    if logprobs.is_cuda:
        from ddtree.engine.reference.fast import tree_build

        if tree_build.runs(logprobs[None], budget):
            # One kernel builds the same tree (fast/tree_build.py): the steps below launch ~5 a depth.
            tokens, depths, parents, visible, scores = tree_build.build(root_t, logprobs[None], budget)
            n = tokens.shape[1]
            tree = Tree(tokens[0], depths[0], parents[0], n <= 2 or vocab == 1,
                        min(depth_count, n - 1), visible[0])
            return tree, scores[0]

    k = min(budget, vocab)
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1)       # [L, k], ranks best first
    top_vals = top_vals.clamp(max=0.0)
    layout = _layout(budget, k, depth_count, device)
    # Layout: index 0 the root, then each depth's beam in turn. A depth's step is four kernels
    # (the outer sum, the candidate gather, topk); its tokens and parents are gathered for all
    # depths at once after the loop, from the picks.
    scores, picks = [zero_f, top_vals[0]], []
    beam, width = top_vals[0], k
    for d in range(1, depth_count):
        used = layout.pairs_within[width - 1]
        cand = (beam[:, None] + top_vals[d][None, :]).view(-1).index_select(0, layout.flat[:used])
        new_width = layout.widths[d]
        beam, pick = torch.topk(cand, new_width)                # sorted: beam stays best first
        scores.append(beam)
        picks.append(pick)
        width = new_width
    if picks:
        pick = torch.cat(picks)
        deep_tokens = top_ids.view(-1).index_select(0, layout.token_base + layout.cols.index_select(0, pick))
        deep_parents = layout.parent_base + layout.rows.index_select(0, pick)
        tokens = torch.cat((root_t, top_ids[0], deep_tokens))
        parents = torch.cat((layout.shallow_parents, deep_parents))
    else:
        tokens = torch.cat((root_t, top_ids[0]))
        parents = layout.shallow_parents
    all_scores = torch.cat(scores)
    total = all_scores.shape[0]
    n = 1 + min(budget, total - 1)

    # Keep everything above the n-th best score, then fill up with the earliest ties.
    cut = torch.topk(all_scores, n).values[n - 1:]
    above = all_scores > cut
    tie = all_scores == cut
    room = n - above.sum()
    keep = above | (tie & (tie.cumsum(0) <= room))
    perm, slot, _ = partition(keep)
    sel = perm[:n]
    tree_parents = slot.index_select(0, parents.index_select(0, sel))
    max_depth = min(depth_count, n - 1)
    chain = n <= 2 or vocab == 1
    tree = Tree(tokens.index_select(0, sel), layout.depths.index_select(0, sel),
                tree_parents, chain, max_depth, ancestor_matrix(tree_parents, max_depth))
    return tree, all_scores.index_select(0, sel)


@dataclass(frozen=True)
class _Layout:
    """What a tree build of one (budget, k, depth) needs that does not depend on the log-probs:
    made once per shape from Python ints and device fills (no host copy), then reused, also by
    the captured graphs (their warm-up builds it before the capture)."""
    widths: tuple[int, ...]          # beam width per depth (0-based)
    pairs_within: list[int]          # see _candidate_pairs
    rows: torch.Tensor               # [P] parent rank of each candidate pair
    cols: torch.Tensor               # [P] token rank of each candidate pair
    flat: torch.Tensor               # [P] rows * k + cols: the pair's index in the outer sum
    depths: torch.Tensor             # [1 + sum(widths)] each layout index's depth (root 0)
    shallow_parents: torch.Tensor    # [1 + k] zeros: the root's and depth 1's parents
    token_base: torch.Tensor         # [sum(widths[1:])] d*k for a node of 0-based depth d
    parent_base: torch.Tensor        # [sum(widths[1:])] layout index of its parent beam's first node


# Unbounded on purpose: captured graphs (the single path's tree graphs, the batched rounds) read
# these tensors by address and hold no reference to them, so an evicted layout would be freed
# under a graph that still replays it. The keys are few: budgets x depths x devices.
@functools.cache
def _layout(budget: int, k: int, depth_count: int, device: torch.device) -> _Layout:
    rows, cols, pairs_within = _candidate_pairs(budget, k, device)
    widths = beam_widths(budget, k, depth_count)
    long = {"dtype": torch.long, "device": device}
    depths = [torch.zeros(1, **long)] + [torch.full((w,), d + 1, **long) for d, w in enumerate(widths)]
    firsts = [1]
    for w in widths[:-1]:
        firsts.append(firsts[-1] + w)
    token_base = [torch.full((w,), d * k, **long) for d, w in enumerate(widths) if d]
    parent_base = [torch.full((w,), firsts[d - 1], **long) for d, w in enumerate(widths) if d]
    empty = torch.zeros(0, **long)
    return _Layout(tuple(widths), pairs_within, rows, cols, rows * k + cols, torch.cat(depths),
                   torch.zeros(1 + k, **long), torch.cat(token_base) if token_base else empty,
                   torch.cat(parent_base) if parent_base else empty)


def _candidate_pairs(budget: int, k: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (parent rank i, token rank j) pairs worth extending: (i+1)(j+1) <= budget, row-major.

    With the beam and each depth's tokens sorted best first, pair (i, j) is beaten by every pair
    at or before it in both ranks, (i+1)(j+1) of them, so beyond the budget it can be dropped:
    about M ln M candidates per depth instead of M*k. Row i keeps min(k, M // (i+1)) pairs;
    pairs_within[w-1] counts those of the first w rows, at least min(M, w*k) (with x0 = M // k
    full rows and remainder r < k, row x0 alone adds floor(M / (x0+1)) >= r). Built on the
    device from aranges, so no host values travel.
    """
    pairs_within = _pairs_within(budget, k)
    lens = torch.minimum(torch.full((budget,), k, device=device),
                         budget // torch.arange(1, budget + 1, device=device))
    ends = lens.cumsum(0)
    flat = torch.arange(pairs_within[-1], device=device)
    rows = torch.searchsorted(ends, flat, right=True)
    cols = flat - (ends - lens).index_select(0, rows)
    return rows, cols, pairs_within


@functools.lru_cache(maxsize=256)
def beam_widths(budget: int, k: int, depth_count: int) -> tuple[int, ...]:
    """Each depth's beam width in a device build: k at depth 1, then min(budget, width * k)."""
    widths = [k]
    for _ in range(1, depth_count):
        widths.append(min(budget, widths[-1] * k))
    return tuple(widths)


@functools.lru_cache(maxsize=64)
def _pairs_within(budget: int, k: int) -> list[int]:
    return list(itertools.accumulate(min(k, budget // (i + 1)) for i in range(budget)))


def partition(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable partition of [T] bool: (perm, slot, count) with the kept indices first.

    perm lists the kept indices in ascending order, then the others in ascending order; slot is
    its inverse (slot[perm[i]] == i); count (0-dim) is how many were kept. Every slot is distinct,
    so the scatter is deterministic.
    """
    idx = torch.arange(keep.shape[0], device=keep.device)
    seen = keep.long().cumsum(0)                              # kept ones up to and including i
    count = seen[-1]
    slot = torch.where(keep, seen - 1, count + idx - seen)
    perm = torch.empty_like(idx).scatter_(0, slot, idx)
    return perm, slot, count


def walk_device(tree: Tree, posterior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted_path on the device: (order [n] long, count 0-dim long), no host sync.

    order[:count] equals accepted_path(tree, posterior): the accepted nodes, root first, in index
    order (root to leaf, since parents precede children); the other nodes follow in index order.
    """
    matched = tree.tokens == posterior.index_select(0, tree.parents)
    matched[:1] = True
    ok = ~(tree.ancestors() & ~matched[None, :]).any(dim=1)
    order, _, count = partition(ok)
    return order, count


def fetch_walk(tree: Tree, posterior: torch.Tensor, order: torch.Tensor,
               count: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """Bring a device walk to the host in one transfer: (path, path_list, new_tokens).

    path is order[:count] (on the device), path_list the same as ints, new_tokens the committed
    tokens: those of path[1:], then the target's choice at the last accepted node (the next bonus),
    exactly what Session._walk returns. count, order and the tokens are packed into one tensor
    and read with one .tolist(): the round's single host sync.
    """
    n = order.shape[0]
    last = order.gather(0, (count - 1).reshape(1))
    after = torch.cat((tree.tokens.index_select(0, order[1:]), posterior.index_select(0, last)))
    # Step i commits the token of the next node on the path, except the last step: the bonus.
    at_end = torch.arange(n, device=order.device) == count - 1
    new = torch.where(at_end, posterior.index_select(0, last), after)
    packed = torch.cat((count.reshape(1).long(), order, new.long())).tolist()
    c = packed[0]
    return order[:c], packed[1:1 + c], packed[1 + n:1 + n + c]
