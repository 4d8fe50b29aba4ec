"""Draft trees for a batched round: b sessions' trees built, padded and walked together.

tree.build_tree_device and tree.walk_device do one session's tree in a handful of kernels; a
round over b sessions would launch b times as many and sync b times. Here the same algorithms
run with a leading batch dimension, so the whole round's trees cost one build per budget group,
one walk, and one host read (fetch_walks). As in tree.py, every shape follows from Python ints
(b, budget, L, V, q) alone and nothing is read back except in fetch_walks, so each function
can be captured in a CUDA graph.

Rows of one TreeBatch share a node count n. Rows of different kinds (budgets, chains, AR rows)
are brought to one width q by pad_batch: a padded node carries token -1, which no target choice
equals, and sees only itself, so it never joins a walk and never hides a real node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast import tree_build
from ddtree.engine.reference.tree import Tree, _layout


@dataclass(frozen=True)
class TreeBatch:
    tokens: torch.Tensor     # [b, n] long; -1 at padded nodes
    depths: torch.Tensor     # [b, n] long; 0 at padded nodes
    parents: torch.Tensor    # [b, n] long; 0 at the root and at padded nodes
    visible: torch.Tensor    # [b, n, n] bool: row i sees j iff j is i or an ancestor of i
    sizes: tuple[int, ...]   # real nodes per row (host ints, known from the shapes that made it)

    def __post_init__(self):
        # Shapes only: checking values would cost a host sync.
        b, n = self.tokens.shape if self.tokens.dim() == 2 else (-1, -1)
        if b < 0 or self.depths.shape != (b, n) or self.parents.shape != (b, n):
            raise BadParams("tree batch tokens, depths and parents must share one [b, n] shape, got "
                            f"{tuple(self.tokens.shape)}, {tuple(self.depths.shape)}, "
                            f"{tuple(self.parents.shape)}")
        if self.visible.shape != (b, n, n):
            raise BadParams(f"tree batch visible must be [{b}, {n}, {n}], got {tuple(self.visible.shape)}")
        if len(self.sizes) != b or any(not 1 <= s <= n for s in self.sizes):
            raise BadParams(f"tree batch sizes must be {b} ints in 1..{n}, got {self.sizes}")

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def row(self, r: int) -> Tree:
        """Row r's real nodes as a single Tree (views, no copy), for the per-session paths.

        max_depth is the bound size-1 (the depth itself is on the device), and is_chain False:
        a chain still verifies correctly under its ancestor mask.
        """
        s = self.sizes[r]
        return Tree(self.tokens[r, :s], self.depths[r, :s], self.parents[r, :s], s == 1, s - 1,
                    self.visible[r, :s, :s])


def build_trees_device(roots: torch.Tensor, logprobs: torch.Tensor, budget: int) -> TreeBatch:
    """Row r is build_tree_device(roots[r], logprobs[r], budget), node for node.

    roots [b] long, logprobs [b, L, V]. The same beam-by-depth steps as
    tree.build_tree_device_scored (read that docstring for why they are exact), each step now one
    kernel over all rows: topk over the last dim, the candidate pairs picked with index_select on
    dim 1, the cut and the stable partition per row. Every row has n = 1 + min(budget, prefixes).
    """
    if logprobs.dim() != 3:
        raise BadParams(f"logprobs must be [batch, depth, vocab], got shape {tuple(logprobs.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise BadParams(f"tree budget must be an int >= 0, got {budget!r}")
    b, depth_count, vocab = logprobs.shape
    roots = _roots_column(roots, b, logprobs.device)
    if budget == 0 or depth_count == 0 or vocab == 0:
        return roots_only(roots[:, 0])

    if tree_build.runs(logprobs, budget):  # the same tree in one kernel, on CUDA
        tokens, depths, parents, visible, _ = tree_build.build(roots[:, 0], logprobs, budget)
        return TreeBatch(tokens, depths, parents, visible, (tokens.shape[1],) * b)
    return build_trees_steps(roots, logprobs, budget)


def build_trees_steps(roots: torch.Tensor, logprobs: torch.Tensor, budget: int) -> TreeBatch:
    """build_trees_device's torch steps, on any device (roots [b, 1] long on logprobs' device,
    budget >= 1, logprobs [b, L, V] with L, V >= 1): what the CPU runs, and what the tree kernel
    is measured and tested against on CUDA."""
    b, depth_count, vocab = logprobs.shape
    k = min(budget, vocab)
    top_vals, top_ids = torch.topk(logprobs, k, dim=-1)       # [b, L, k], ranks best first
    top_vals = top_vals.clamp(max=0.0)                         # a child never outscores its parent
    layout = _layout(budget, k, depth_count, logprobs.device)
    scores, picks = [torch.zeros_like(top_vals[:, 0, :1]), top_vals[:, 0]], []
    beam, width = top_vals[:, 0], k
    for d in range(1, depth_count):
        used = layout.pairs_within[width - 1]
        outer = (beam[:, :, None] + top_vals[:, d, None, :]).reshape(b, -1)
        cand = outer.index_select(1, layout.flat[:used])
        beam, pick = torch.topk(cand, layout.widths[d], dim=-1)  # sorted, as in the single build
        scores.append(beam)
        picks.append(pick)
        width = layout.widths[d]
    shallow = torch.cat((roots, top_ids[:, 0]), dim=1)
    parents = layout.shallow_parents.expand(b, -1)
    if picks:
        pick = torch.cat(picks, dim=1)                          # [b, deep nodes] pair indices
        cols = layout.cols.index_select(0, pick.reshape(-1)).view_as(pick)
        rows = layout.rows.index_select(0, pick.reshape(-1)).view_as(pick)
        deep_tokens = top_ids.reshape(b, -1).gather(1, layout.token_base + cols)
        tokens = torch.cat((shallow, deep_tokens), dim=1)
        parents = torch.cat((parents, layout.parent_base + rows), dim=1)
    else:
        tokens = shallow
    all_scores = torch.cat(scores, dim=1)
    total = all_scores.shape[1]
    n = 1 + min(budget, total - 1)

    # Keep everything above each row's n-th best score, then fill up with that row's earliest
    # ties: the single build's rule, row by row.
    cut = torch.topk(all_scores, n, dim=-1).values[:, n - 1:]
    above = all_scores > cut
    tie = all_scores == cut
    room = n - above.sum(dim=1, keepdim=True)
    keep = above | (tie & (tie.cumsum(1) <= room))
    perm, slot, _ = partition_rows(keep)
    sel = perm[:, :n]
    tree_parents = slot.gather(1, parents.gather(1, sel))
    depths = layout.depths.index_select(0, sel.reshape(-1)).view(b, n)
    visible = ancestor_rows(tree_parents, min(depth_count, n - 1))
    return TreeBatch(tokens.gather(1, sel), depths, tree_parents, visible, (n,) * b)


def chains_device(roots: torch.Tensor, draft_logits: torch.Tensor) -> TreeBatch:
    """DFlash chains, one per row: the bonus roots[r], then the argmax of draft_logits[r] [L, V]
    at each depth (backend.chain_of, batched)."""
    if draft_logits.dim() != 3:
        raise BadParams(f"draft logits must be [batch, depth, vocab], got shape {tuple(draft_logits.shape)}")
    b, depth_count, _ = draft_logits.shape
    roots = _roots_column(roots, b, draft_logits.device)
    tokens = torch.cat((roots, draft_logits.argmax(dim=-1)), dim=1)
    n = 1 + depth_count
    steps = torch.arange(n, device=draft_logits.device)
    visible = torch.ones((n, n), dtype=torch.bool, device=draft_logits.device).tril()
    return TreeBatch(tokens, steps.expand(b, n).clone(), (steps - 1).clamp(min=0).expand(b, n).clone(),
                     visible.expand(b, n, n).clone(), (n,) * b)


def roots_only(roots: torch.Tensor) -> TreeBatch:
    """The bonus token alone per row: AR rows, or rows with no room left to draft."""
    if roots.dim() != 1:
        raise BadParams(f"roots must be [batch], got shape {tuple(roots.shape)}")
    b = roots.shape[0]
    zeros = torch.zeros((b, 1), dtype=torch.long, device=roots.device)
    visible = torch.ones((b, 1, 1), dtype=torch.bool, device=roots.device)
    return TreeBatch(roots.reshape(b, 1).long(), zeros, zeros.clone(), visible, (1,) * b)


def pad_batch(parts: list[TreeBatch], q: int) -> TreeBatch:
    """The rows of parts, in the order given, widened to q nodes each (see the module docstring
    for what a padded node holds). sizes keeps each row's real size."""
    if not parts:
        raise BadParams("pad_batch needs at least one tree batch")
    widest = max(p.width for p in parts)
    if isinstance(q, bool) or not isinstance(q, int) or q < widest:
        raise BadParams(f"pad width must be an int >= the widest part ({widest}), got {q!r}")
    device = parts[0].tokens.device
    eye = torch.eye(q, dtype=torch.bool, device=device)
    tokens, depths, parents, visible, sizes = [], [], [], [], []
    for p in parts:
        extra = q - p.width
        tokens.append(torch.nn.functional.pad(p.tokens, (0, extra), value=-1))
        depths.append(torch.nn.functional.pad(p.depths, (0, extra)))
        parents.append(torch.nn.functional.pad(p.parents, (0, extra)))
        # The old block in the top-left corner, and each padded node sees only itself.
        visible.append(torch.nn.functional.pad(p.visible, (0, extra, 0, extra)) | eye)
        sizes.extend(p.sizes)
    return TreeBatch(torch.cat(tokens), torch.cat(depths), torch.cat(parents), torch.cat(visible),
                     tuple(sizes))


def walk_batch(trees: TreeBatch, posterior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """walk_device for every row at once: (order [b, q] long, count [b] long), no host sync.

    posterior [b, q] holds the target's choice at each node. A node is accepted when it and every
    ancestor carry the choice made at their parent; order[r, :count[r]] lists row r's accepted
    nodes root first, as walk_device does for the row's real tree. Padded nodes (token -1, seen
    by no real node) are never accepted.
    """
    if posterior.shape != trees.tokens.shape:
        raise BadParams(f"posterior must be {tuple(trees.tokens.shape)}, got {tuple(posterior.shape)}")
    matched = trees.tokens == posterior.gather(1, trees.parents)
    matched[:, :1] = True
    ok = ~(trees.visible & ~matched[:, None, :]).any(dim=2)
    order, _, count = partition_rows(ok)
    return order, count


def fetch_walks(trees: TreeBatch, posterior: torch.Tensor, order: torch.Tensor,
                count: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """Every row's walk on the host in one transfer: per row (path_list, new_tokens), exactly
    fetch_walk's second and third items. The counts, orders and committed tokens of all rows
    go in one tensor and one .tolist(): the round's single host sync."""
    return unpack_walks(pack_walks(trees.tokens, posterior, order, count).tolist())


def pack_walks(tokens: torch.Tensor, posterior: torch.Tensor, order: torch.Tensor,
               count: torch.Tensor) -> torch.Tensor:
    """[b, 1 + 2q] long on the device: each row's count, its order, then the tokens it commits
    (graph-ready: fast/batch_graph.py packs inside the captured round)."""
    q = order.shape[1]
    last = order.gather(1, (count - 1)[:, None])
    bonus = posterior.gather(1, last)                          # [b, 1] the next round's root
    after = torch.cat((tokens.gather(1, order[:, 1:]), bonus), dim=1)
    # Step i commits the token of the path's next node, except the last step: the bonus.
    at_end = torch.arange(q, device=order.device)[None, :] == (count - 1)[:, None]
    new = torch.where(at_end, bonus, after)
    return torch.cat((count[:, None].long(), order, new.long()), dim=1)


def unpack_walks(packed: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """pack_walks' rows, read on the host, as (path_list, new_tokens) per row."""
    if not packed:
        return []
    q = (len(packed[0]) - 1) // 2
    return [(row[1:1 + row[0]], row[1 + q:1 + q + row[0]]) for row in packed]


def partition_rows(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree.partition on each row of keep [b, T]: (perm [b, T], slot [b, T], count [b]).

    Per row: kept indices first in ascending order, then the rest in ascending order; slot is
    perm's inverse. Slots in a row are distinct, so the scatter is deterministic.
    """
    idx = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    seen = keep.long().cumsum(1)
    count = seen[:, -1]
    slot = torch.where(keep, seen - 1, count[:, None] + idx - seen)
    perm = torch.empty_like(slot).scatter_(1, slot, idx)
    return perm, slot, count


def ancestor_rows(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """tree.ancestor_matrix per row of parents [b, n]: [b, n, n] bool, by pointer jumping
    (ceil(log2(max_depth + 1)) gathers, max_depth a host int bound)."""
    b, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    up = parents
    reach = 1
    while reach <= max_depth:
        anc = anc | anc.gather(1, up[:, :, None].expand(b, n, n))
        up = up.gather(1, up)
        reach *= 2
    return anc.contiguous()


def _roots_column(roots: torch.Tensor, b: int, device) -> torch.Tensor:
    if not isinstance(roots, torch.Tensor) or roots.shape != (b,):
        raise BadParams(f"roots must be a [{b}] tensor, got {getattr(roots, 'shape', roots)!r}")
    return roots.to(device=device, dtype=torch.long).reshape(b, 1)
