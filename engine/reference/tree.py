"""Draft trees: best-first construction, the ancestor mask, and the walk.

Node 0 is the root (the bonus token, already committed); nodes 1..M are draft tokens in the order
the best-first search produced them, which puts every parent before its children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


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
