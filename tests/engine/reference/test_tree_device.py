"""The device-side tree: build_tree_device's node set, its shape guarantees, and the device walk."""

import ast
import inspect
import textwrap

import pytest
import torch

from ddtree.engine.reference import tree as tree_mod
from ddtree.engine.reference.backends import TransformersPath
from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.tree import (
    accepted_path,
    build_tree,
    build_tree_device,
    build_tree_device_scored,
    chain_tree,
    fetch_walk,
    root_tree,
    tree_scores,
    walk_device,
)

from .tree_support import all_prefix_scores, check_structure, python_walk, random_logprobs, tied_logprobs


def _prefix_count(depth: int, vocab: int) -> int:
    return sum(vocab ** d for d in range(1, depth + 1))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("depth,vocab", [(3, 4), (4, 3), (2, 6), (5, 2)])
def test_nodes_are_the_most_probable_prefixes(seed, depth, vocab):
    logprobs = random_logprobs(depth, vocab, seed)
    everything = all_prefix_scores(logprobs)
    for budget in (1, 2, vocab - 1, vocab, vocab + 1, 7, 19, len(everything), len(everything) + 5):
        tree, scores = build_tree_device_scored(11, logprobs, budget)
        n = min(budget, len(everything))
        assert tree.size == 1 + n
        assert tree.tokens[0] == 11
        check_structure(tree, logprobs)
        assert scores.tolist() == pytest.approx(tree_scores(tree, logprobs).tolist(), abs=1e-5)
        assert sorted(scores[1:].tolist(), reverse=True) == pytest.approx(everything[:n], abs=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_same_score_multiset_as_build_tree(seed):
    logprobs = random_logprobs(7, 40, seed)
    for budget in (1, 8, 33, 120):
        host = build_tree(3, logprobs, budget)
        dev = build_tree_device(3, logprobs, budget)
        assert dev.size == host.size
        want = sorted(tree_scores(host, logprobs).tolist())
        assert sorted(tree_scores(dev, logprobs).tolist()) == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("seed", range(12))
def test_ties_and_exact_zeros_still_give_closed_optimal_trees(seed):
    depth, vocab = (3, 4) if seed % 2 else (4, 3)
    logprobs = tied_logprobs(depth, vocab, seed)
    everything = all_prefix_scores(logprobs)
    for budget in range(1, len(everything) + 3):
        tree, scores = build_tree_device_scored(0, logprobs, budget)
        n = min(budget, len(everything))
        assert tree.size == 1 + n
        check_structure(tree, logprobs)
        assert sorted(scores[1:].tolist(), reverse=True) == everything[:n]


def test_all_zero_log_probs_take_the_shallow_prefixes_first():
    # Every prefix scores 0: only the layout's tie-break keeps the tree closed.
    logprobs = torch.zeros(4, 3)
    for budget in range(1, 40):
        tree = build_tree_device(0, logprobs, budget)
        check_structure(tree, logprobs)
        depths = tree.depths.tolist()
        assert depths == sorted(depths)


def test_root_may_stay_a_tensor():
    logprobs = random_logprobs(3, 5, 0)
    for root in (torch.tensor(9), torch.tensor([9])):
        tree = build_tree_device(root, logprobs, 6)
        assert tree.tokens.tolist() == build_tree_device(9, logprobs, 6).tokens.tolist()
        assert tree.tokens[0] == 9 and tree.tokens.dtype == torch.long


def test_budget_zero_and_trivial_shapes():
    logprobs = random_logprobs(3, 5, 0)
    tree = build_tree_device(4, logprobs, 0)
    assert tree.tokens.tolist() == [4] and tree.is_chain and tree.ancestors().tolist() == [[True]]
    one = build_tree_device(4, logprobs, 1)
    assert one.is_chain and one.size == 2 and one.tokens[1] == logprobs[0].argmax()
    chain = build_tree_device(4, torch.zeros(5, 1), 3)   # vocab 1: one token per depth
    assert chain.is_chain and chain.parents.tolist() == [0, 0, 1, 2]
    wide = build_tree_device(4, logprobs, 8)
    assert not wide.is_chain   # unknown without a sync; the mask covers chains anyway
    for bad in (-1, 2.0, True):
        with pytest.raises(BadParams):
            build_tree_device(4, logprobs, bad)
    with pytest.raises(BadParams):
        build_tree_device(4, logprobs[0], 3)


def test_shapes_depend_on_budget_and_shape_only():
    depth, vocab, budget = 4, 6, 50
    patterns = [
        random_logprobs(depth, vocab, 1),
        torch.zeros(depth, vocab),
        torch.full((depth, vocab), -3.0),
        torch.log_softmax(torch.tensor([[0.0] + [-float("inf")] * (vocab - 1)] * depth), -1),
    ]
    for lp in patterns:
        tree = build_tree_device(0, lp, budget)
        assert tree.size == 1 + budget and tree.max_depth == depth
        assert tree.ancestors().shape == (1 + budget, 1 + budget)
        order, count = walk_device(tree, torch.zeros(tree.size, dtype=torch.long))
        assert order.shape == (tree.size,) and count.shape == ()
    assert build_tree_device(0, torch.zeros(2, 3), 100).size == 1 + _prefix_count(2, 3)


def _code(fn) -> str:
    """A function's code without its docstring and comments."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if ast.get_docstring(node) is not None:
        node.body = node.body[1:]
    return ast.unparse(node)


def test_device_functions_read_nothing_back_to_the_host():
    for fn in (build_tree_device, build_tree_device_scored, tree_mod.partition,
               tree_mod._candidate_pairs, walk_device,
               tree_mod.ancestor_matrix, tree_mod._layout.__wrapped__):
        src = _code(fn)
        for syncing in (".item(", ".tolist(", "nonzero(", "int(", "float(", "bool(", ".cpu(",
                        "torch.tensor(", ".numpy(", "torch.equal("):
            assert syncing not in src, (fn.__name__, syncing)
    assert _code(fetch_walk).count(".tolist(") == 1 and "item(" not in _code(fetch_walk)


def _posterior_down(tree, leaf: int, vocab: int, g) -> torch.Tensor:
    """Random choices, except along the path to `leaf`, where each node chooses the next one."""
    posterior = torch.randint(0, vocab, (tree.size,), generator=g)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    j = leaf
    while j != 0:
        posterior[parents[j]] = tokens[j]
        j = parents[j]
    return posterior


def _trees(seed: int):
    lp = random_logprobs(5, 6, seed)
    yield build_tree_device(2, lp, 40), 6
    yield build_tree(2, lp, 40), 6
    yield chain_tree(2, torch.tensor([1, 4, 0, 3])), 6
    yield root_tree(2, "cpu"), 6
    yield build_tree_device(2, lp, 1), 6


def _session_walk(tree, posterior, vocab):
    """The reference backend's walk (what Session._walk returns on the transformers path)."""
    return TransformersPath(None).walk(tree, posterior)


@pytest.mark.parametrize("seed", range(15))
def test_walk_matches_accepted_path_and_session_walk(seed):
    g = torch.Generator().manual_seed(seed)
    for tree, vocab in _trees(seed):
        deepest = max(range(tree.size), key=lambda i: int(tree.depths[i]))
        cases = [
            _posterior_down(tree, int(torch.randint(0, tree.size, (1,), generator=g)), vocab, g),
            _posterior_down(tree, deepest, vocab, g),                         # fully accepted
            torch.full((tree.size,), vocab + 1, dtype=torch.long),            # root only
            torch.randint(0, vocab, (tree.size,), generator=g),
        ]
        for posterior in cases:
            want = accepted_path(tree, posterior).tolist()
            assert want == python_walk(tree, posterior.tolist())
            order, count = walk_device(tree, posterior)
            assert sorted(order.tolist()) == list(range(tree.size))
            assert order[:int(count)].tolist() == want
            path, path_list, new = fetch_walk(tree, posterior, order, count)
            s_path, s_list, s_new = _session_walk(tree, posterior, vocab + 2)
            assert path.tolist() == s_path.tolist() and path_list == s_list and new == s_new
        full = cases[1]
        assert len(accepted_path(tree, full)) == int(tree.depths[deepest]) + 1
        assert walk_device(tree, cases[2])[1] == 1


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.cuda
def test_cuda_build_and_walk_never_sync():
    logprobs = random_logprobs(15, 1000, 0).cuda()
    root = torch.tensor([7], device="cuda")
    posterior = torch.zeros(257, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in (root, 7):
            tree = build_tree_device(r, logprobs, 256)
            posterior = tree.tokens.roll(-1)   # node i chooses node i+1's token: a long walk
            order, count = walk_device(tree, posterior)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = build_tree(7, logprobs.cpu(), 256)
    want = sorted(tree_scores(host, logprobs.cpu()).tolist())
    assert sorted(tree_scores(tree, logprobs).cpu().tolist()) == pytest.approx(want, abs=1e-4)
    check_structure(tree, logprobs)
    cpu_tree = tree_mod.Tree(tree.tokens.cpu(), tree.depths.cpu(), tree.parents.cpu(), False, 15)
    assert order[:int(count)].tolist() == accepted_path(cpu_tree, posterior.cpu()).tolist()
    path, path_list, new = fetch_walk(tree, posterior, order, count)
    s_path, s_list, s_new = _session_walk(cpu_tree, posterior.cpu(), 1000)
    assert path_list == s_list and new == s_new and path.device.type == "cuda"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(4))
def test_cuda_ties_stay_closed(seed):
    logprobs = tied_logprobs(4, 3, seed).float().cuda()
    everything = all_prefix_scores(logprobs.cpu())
    for budget in (5, 17, 60, 200):
        tree, scores = build_tree_device_scored(0, logprobs, budget)
        n = min(budget, len(everything))
        check_structure(tree, logprobs)
        assert sorted(scores[1:].tolist(), reverse=True) == everything[:n]
