"""Brute-force references for the tree tests (host tree and device tree alike)."""

from __future__ import annotations

import itertools

import torch


def random_logprobs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)


def all_prefix_scores(logprobs: torch.Tensor) -> list[float]:
    """The score of every prefix of length 1..depth, best first, by enumeration."""
    depth, vocab = logprobs.shape
    rows = logprobs.tolist()
    out = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            out.append(sum(rows[i][t] for i, t in enumerate(path)))
    return sorted(out, reverse=True)


def tree_paths(tree) -> list[tuple[int, ...]]:
    """Each non-root node's token path from the root."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(1, tree.size):
        path, j = [], i
        while j != 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return out


def ancestor_sets(tree) -> list[set[int]]:
    """Each node's ancestors, itself and the root included, by walking the parents."""
    parents = tree.parents.tolist()
    out = []
    for i in range(tree.size):
        want, j = {i}, i
        while j != 0:
            j = parents[j]
            want.add(j)
        out.append(want)
    return out


def python_walk(tree, posterior: list[int]) -> list[int]:
    """The accepted path by following, from the root, the child whose token the posterior chose."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children = {}
    for i in range(1, tree.size):
        children.setdefault(parents[i], {})[tokens[i]] = i
    node, path = 0, [0]
    while posterior[node] in children.get(node, {}):
        node = children[node][posterior[node]]
        path.append(node)
    return path


def tied_logprobs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Log-probs from {0, -1, -2, -inf}: small integers add exactly, so ties are real and many."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.randint(0, 3, (depth, vocab), generator=g).double()
    lp[torch.rand(depth, vocab, generator=g) < 0.15] = float("-inf")
    return lp


def check_structure(tree, logprobs):
    """Parents first, depths consistent, distinct paths closed under prefixes, ancestors right."""
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == 0 and depths[0] == 0
    for i in range(1, tree.size):
        assert parents[i] < i
        assert depths[i] == depths[parents[i]] + 1
    assert max(depths) <= tree.max_depth <= logprobs.shape[0]
    paths = tree_paths(tree)
    assert len(set(paths)) == len(paths)
    assert all(p[:-1] in set(paths) for p in paths if len(p) > 1)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in tree.ancestors()] == ancestor_sets(tree)
