import pytest
import torch

from ddtree.engine.reference.tree import (
    accepted_path,
    ancestor_matrix,
    build_tree,
    chain_tree,
    tree_attention_mask,
    tree_scores,
)

from .tree_support import all_prefix_scores, ancestor_sets, python_walk, random_logprobs, tree_paths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 2, 5, 13, 40])
def test_tree_is_the_top_budget_prefixes(seed, budget):
    logprobs = random_logprobs(3, 4, seed)  # 4 + 16 + 64 = 84 prefixes
    tree = build_tree(7, logprobs, budget)
    assert tree.size == budget + 1
    assert tree.tokens[0] == 7 and tree.depths[0] == 0
    got = sorted(tree_scores(tree, logprobs)[1:].tolist(), reverse=True)
    want = all_prefix_scores(logprobs)[:budget]
    assert got == pytest.approx(want, abs=1e-5)
    paths = tree_paths(tree)
    assert len(set(paths)) == len(paths)
    # ancestor-closed: every prefix of a path in the tree is in the tree
    assert all(p[:-1] in set(paths) for p in paths if len(p) > 1)


def test_parents_come_before_children_and_depths_agree():
    tree = build_tree(0, random_logprobs(6, 32, 3), 200)
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i in range(1, tree.size):
        assert parents[i] < i
        assert depths[i] == depths[parents[i]] + 1
    assert tree.max_depth == max(depths)


def test_budget_larger_than_the_prefix_space_takes_them_all():
    tree = build_tree(0, random_logprobs(2, 3, 0), 100)
    assert tree.size == 1 + 3 + 9


def test_chain_detection():
    lp = torch.full((4, 10), -10.0)
    lp[:, 2] = 0.0  # one dominant token per depth: best-first takes the chain first
    tree = build_tree(5, torch.log_softmax(lp, -1), 4)
    assert tree.is_chain and tree.tokens.tolist() == [5, 2, 2, 2, 2]
    chain = chain_tree(5, torch.tensor([1, 2, 3]))
    assert chain.is_chain and chain.parents.tolist() == [0, 0, 1, 2] and chain.depths.tolist() == [0, 1, 2, 3]


def test_ancestor_matrix_and_mask_match_brute_force():
    tree = build_tree(0, random_logprobs(5, 6, 11), 60)
    n = tree.size
    anc = ancestor_matrix(tree.parents, tree.max_depth)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in anc] == ancestor_sets(tree)
    mask = tree_attention_mask(tree, 9, torch.float32)
    assert mask.shape == (1, 1, n, 9 + n) and mask.dtype == torch.float32
    assert (mask[0, 0, :, :9] == 0).all()
    assert torch.equal(mask[0, 0, :, 9:] == 0, anc)
    assert (mask[0, 0, :, 9:][~anc] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("seed", range(20))
def test_walk_matches_a_python_walk(seed):
    vocab = 5
    tree = build_tree(1, random_logprobs(4, vocab, seed), 30)
    g = torch.Generator().manual_seed(seed)
    # Posteriors biased toward the tree's own tokens so that long paths occur.
    posterior = torch.where(torch.rand(tree.size, generator=g) < 0.7,
                            torch.zeros(tree.size, dtype=torch.long),
                            torch.randint(0, vocab, (tree.size,), generator=g))
    children_best = {}
    for i in range(1, tree.size):
        children_best.setdefault(int(tree.parents[i]), int(tree.tokens[i]))
    for parent, tok in children_best.items():
        if torch.rand(1, generator=g) < 0.8:
            posterior[parent] = tok
    assert accepted_path(tree, posterior).tolist() == python_walk(tree, posterior.tolist())


def test_chain_walk_stops_at_first_mismatch():
    chain = chain_tree(9, torch.tensor([1, 2, 3, 4]))
    assert accepted_path(chain, torch.tensor([1, 2, 0, 4, 0])).tolist() == [0, 1, 2]
    assert accepted_path(chain, torch.tensor([0, 2, 3, 4, 0])).tolist() == [0]
    assert accepted_path(chain, torch.tensor([1, 2, 3, 4, 7])).tolist() == [0, 1, 2, 3, 4]
