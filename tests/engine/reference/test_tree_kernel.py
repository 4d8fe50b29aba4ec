"""The one-kernel tree build (fast/tree_build.py) against the torch steps and brute force.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py), so these check the
kernel code itself on a CPU, at small shapes (the interpreter is slow). On CUDA the device
builders dispatch to it, so the CUDA tests of test_tree_device.py and test_batch_tree.py run it too;
the ones here add a graph capture and a budget of 256 over a real vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.fast import tree_build
from ddtree.engine.reference.fast.batch_tree import TreeBatch, build_trees_device, build_trees_steps
from ddtree.engine.reference.tree import Tree, tree_scores

from .test_tree_attention import _runs_here
from .tree_support import all_prefix_scores, check_structure, random_logprobs, tied_logprobs

pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton: CUDA, or its interpreter 3.7.1+")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_build(roots, logprobs, budget) -> TreeBatch:
    """The torch steps on the same device (on CUDA build_trees_device would take the kernel)."""
    batch = build_trees_steps(roots[:, None], logprobs, budget)
    return TreeBatch(*(x.cpu() for x in (batch.tokens, batch.depths, batch.parents, batch.visible)), batch.sizes)


def _rows(built, r: int, depth: int) -> Tree:
    tokens, depths, parents, visible, _ = (x.cpu() for x in built)
    n = tokens.shape[1]
    return Tree(tokens[r], depths[r], parents[r], False, min(depth, n - 1), visible[r])


@pytest.mark.parametrize("b,depth,vocab,budget", [(1, 3, 50, 4), (2, 5, 64, 16), (3, 4, 40, 32),
                                                 (2, 2, 7, 30), (1, 1, 10, 5), (2, 4, 3, 50)])
def test_same_tree_as_the_torch_steps_node_for_node(b, depth, vocab, budget):
    # Random log-probs have no ties, so the trees are equal, not just equally good.
    logprobs = torch.stack([random_logprobs(depth, vocab, 100 * b + r) for r in range(b)]).to(DEVICE)
    roots = torch.arange(b, device=DEVICE) + 3
    built = tree_build.build(roots, logprobs, budget)
    want = _torch_build(roots, logprobs, budget)
    tokens, depths, parents, visible, scores = built
    assert tokens.cpu().equal(want.tokens) and depths.cpu().equal(want.depths)
    assert parents.cpu().equal(want.parents) and visible.cpu().equal(want.visible)
    for r in range(b):
        tree = _rows(built, r, depth)
        assert scores[r].cpu().tolist() == pytest.approx(tree_scores(tree, logprobs[r].cpu()).tolist(), abs=1e-5)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_pruned_and_unpruned_depths_give_the_same_tree(scale):
    # Flat drafts (small scale) leave no candidate above depth 1's worst below depth 1, so the
    # kernel prunes every deeper depth: a star. Peaked ones keep deep beams, wider than the
    # narrow sorts. The tree is the torch steps' either way.
    g = torch.Generator().manual_seed(int(scale * 100))
    logprobs = torch.log_softmax(torch.randn(2, 5, 48, generator=g) * scale, dim=-1).to(DEVICE)
    roots = torch.tensor([1, 2], device=DEVICE)
    for budget in (8, 24):
        built = tree_build.build(roots, logprobs, budget)
        want = _torch_build(roots, logprobs, budget)
        assert built[0].cpu().equal(want.tokens) and built[2].cpu().equal(want.parents)
        assert built[3].cpu().equal(want.visible)
        if scale < 0.1:
            assert built[1].cpu().max() == 1


@pytest.mark.parametrize("seed", range(4))
def test_ties_give_closed_trees_of_the_best_scores(seed):
    # {0, -1, -2, -inf}: sums are exact, ties are many; a tie goes to the earlier candidate.
    depth, vocab = (3, 4) if seed % 2 else (4, 3)
    logprobs = tied_logprobs(depth, vocab, seed).float()
    everything = all_prefix_scores(logprobs)
    for budget in (1, 3, 9, 17, len(everything) + 2):
        built = tree_build.build(torch.tensor([5], device=DEVICE), logprobs[None].to(DEVICE), budget)
        tree = _rows(built, 0, depth)
        n = min(budget, len(everything))
        assert tree.size == 1 + n and tree.tokens[0] == 5
        check_structure(tree, logprobs)
        assert sorted(built[4][0, 1:].cpu().tolist(), reverse=True) == everything[:n]


def test_all_zero_log_probs_keep_the_tree_closed():
    # Every prefix scores 0 (and -0.0 equals 0.0): only the layout order decides, parents first.
    logprobs = torch.zeros(1, 4, 3, device=DEVICE)
    logprobs[0, 1, 0] = -0.0
    for budget in (2, 5, 13, 40):
        tree = _rows(tree_build.build(torch.zeros(1, dtype=torch.long, device=DEVICE), logprobs, budget), 0, 4)
        check_structure(tree, logprobs[0].cpu())
        assert tree.depths.tolist() == sorted(tree.depths.tolist())


def test_production_dispatch_is_cuda_float32_only(monkeypatch):
    logprobs = torch.zeros(1, 3, 5)
    assert not tree_build.runs(logprobs, 4)           # a CPU tensor keeps the torch steps
    # Sorts wider than a program takes: many depths, or few depths with many candidate pairs.
    assert tree_build._fits(256, 256, 15) and not tree_build._fits(300, 300, 15)
    assert not tree_build._fits(4000, 4000, 2)
    calls = []
    real = tree_build.build
    monkeypatch.setattr(tree_build, "build", lambda *a: calls.append(a) or real(*a))
    build_trees_device(torch.zeros(1, dtype=torch.long), logprobs, 4)
    assert not calls
    if torch.cuda.is_available():
        assert tree_build.runs(logprobs.cuda(), 4)
        assert not tree_build.runs(logprobs.cuda().double(), 4)
        assert not tree_build.runs(logprobs.cuda(), 0)
        assert not tree_build.runs(torch.zeros(1, 2, 5000, device="cuda"), 4000)  # too wide
        build_trees_device(torch.zeros(1, dtype=torch.long, device="cuda"), logprobs.cuda(), 4)
        assert len(calls) == 1


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.cuda
def test_cuda_budget_256_matches_the_torch_steps_in_a_graph():
    # The real shape of a DDTree-256 round on Qwen3 (15 depths, a 151936-token vocabulary),
    # captured once and replayed on new log-probs, as the backends do.
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(2, 15, 151936, device="cuda")
    roots = torch.tensor([11, 12], device="cuda")

    def fill(seed):
        g.manual_seed(seed)
        logits.copy_(torch.randn(2, 15, 151936, generator=g) * 4)

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            tree_build.build(roots, torch.log_softmax(logits, -1), 256)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        built = tree_build.build(roots, torch.log_softmax(logits, -1), 256)
    for seed in (1, 2):
        fill(seed)
        graph.replay()
        want = _torch_build(roots, torch.log_softmax(logits, -1), 256)
        assert built[0].cpu().equal(want.tokens) and built[2].cpu().equal(want.parents)
        assert built[3].cpu().equal(want.visible)
