"""Batched trees: every row equals the single-tree builder, walk and fetch, padded or not."""

import ast
import inspect
import textwrap

import pytest
import torch

from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast import batch_tree
from ddtree.engine.reference.fast.backend import chain_of
from ddtree.engine.reference.fast.batch_tree import (
    TreeBatch,
    build_trees_device,
    chains_device,
    fetch_walks,
    pad_batch,
    roots_only,
    walk_batch,
)
from ddtree.engine.reference.tree import build_tree_device, fetch_walk, root_tree, walk_device

from .tree_support import python_walk

BUDGETS = (1, 2, 4, 16, 64)


def _batch_logprobs(b, depth, vocab, seed, scale=2.0):
    """Random fp32 log-probs; a larger scale makes confident drafts, so deep narrow trees."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(b, depth, vocab, generator=g) * scale, dim=-1)


def _tied_logprobs(b, depth, vocab, seed):
    """Values from {0, -1, -2, -inf}: small integers add exactly, so ties are real and many."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.randint(0, 3, (b, depth, vocab), generator=g).float()
    lp[torch.rand(b, depth, vocab, generator=g) < 0.15] = float("-inf")
    return lp


def _roots(b, seed):
    return torch.randint(0, 1000, (b,), generator=torch.Generator().manual_seed(seed + 100))


def _assert_row_is(batch: TreeBatch, r: int, tree):
    s = batch.sizes[r]
    assert s == tree.size
    assert torch.equal(batch.tokens[r, :s], tree.tokens)
    assert torch.equal(batch.depths[r, :s], tree.depths)
    assert torch.equal(batch.parents[r, :s], tree.parents)
    assert torch.equal(batch.visible[r, :s, :s], tree.ancestors())
    # The row as a Tree is the same tree.
    row = batch.row(r)
    assert torch.equal(row.tokens, tree.tokens) and torch.equal(row.ancestors(), tree.ancestors())


def _assert_padding(batch: TreeBatch, r: int):
    s, q = batch.sizes[r], batch.width
    assert (batch.tokens[r, s:] == -1).all()
    assert (batch.parents[r, s:] == 0).all() and (batch.depths[r, s:] == 0).all()
    vis = batch.visible[r]
    assert not vis[s:, :s].any() and not vis[:s, s:].any()
    assert torch.equal(vis[s:, s:], torch.eye(q - s, dtype=torch.bool))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("b", (1, 3, 5))
@pytest.mark.parametrize("depth", (1, 3, 7))
@pytest.mark.parametrize("vocab", (1, 5, 50))
@pytest.mark.parametrize("scale", (2.0, 6.0))
def test_rows_equal_the_single_builder(seed, b, depth, vocab, scale):
    logprobs, roots = _batch_logprobs(b, depth, vocab, seed, scale), _roots(b, seed)
    for budget in (0,) + BUDGETS:
        batch = build_trees_device(roots, logprobs, budget)
        assert len(set(batch.sizes)) == 1 and batch.sizes[0] == batch.width
        for r in range(b):
            _assert_row_is(batch, r, build_tree_device(roots[r], logprobs[r], budget))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth,vocab", [(3, 4), (7, 5), (2, 50), (5, 2)])
def test_exact_ties_give_the_same_rows(seed, depth, vocab):
    logprobs, roots = _tied_logprobs(4, depth, vocab, seed), _roots(4, seed)
    # A row of all zeros: every prefix of one length ties.
    logprobs[1] = 0.0
    for budget in BUDGETS:
        batch = build_trees_device(roots, logprobs, budget)
        for r in range(4):
            _assert_row_is(batch, r, build_tree_device(roots[r], logprobs[r], budget))


def test_width_depends_on_budget_and_shape_only():
    roots = torch.zeros(3, dtype=torch.long)
    for budget in BUDGETS:
        widths = {build_trees_device(roots, lp, budget).width
                  for lp in (_batch_logprobs(3, 4, 6, 0), _tied_logprobs(3, 4, 6, 1), torch.zeros(3, 4, 6))}
        assert len(widths) == 1
    assert build_trees_device(roots, torch.zeros(3, 2, 3), 100).width == 1 + 3 + 9


@pytest.mark.parametrize("b,depth,vocab", [(1, 1, 1), (3, 4, 7), (5, 7, 50)])
def test_chains_and_roots_equal_the_single_versions(b, depth, vocab):
    g = torch.Generator().manual_seed(b)
    logits, roots = torch.randn(b, depth, vocab, generator=g), _roots(b, 0)
    chains = chains_device(roots, logits)
    assert chains.sizes == (1 + depth,) * b
    alone = roots_only(roots)
    assert alone.sizes == (1,) * b
    for r in range(b):
        _assert_row_is(chains, r, chain_of(roots[r], logits[r], "cpu"))
        _assert_row_is(alone, r, root_tree(int(roots[r]), "cpu"))


def _mixed(seed):
    """A round as the server mixes it: budget-16 rows, a budget-64 row, chains, AR rows; with the
    single trees each row must equal."""
    depth, vocab = 5, 9
    lp16, lp64 = _batch_logprobs(2, depth, vocab, seed), _batch_logprobs(1, depth, vocab, seed + 1)
    logits = torch.randn(2, depth, vocab, generator=torch.Generator().manual_seed(seed))
    r16, r64, rch, rar = _roots(2, seed), _roots(1, seed + 1), _roots(2, seed + 2), _roots(3, seed + 3)
    parts = [build_trees_device(r16, lp16, 16), build_trees_device(r64, lp64, 64),
             chains_device(rch, logits), roots_only(rar)]
    singles = ([build_tree_device(r16[i], lp16[i], 16) for i in range(2)]
               + [build_tree_device(r64[0], lp64[0], 64)]
               + [chain_of(rch[i], logits[i], "cpu") for i in range(2)]
               + [root_tree(int(t), "cpu") for t in rar])
    return parts, singles, vocab


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("extra", (0, 3))
def test_pad_batch_keeps_every_row_and_pads_inertly(seed, extra):
    parts, singles, _ = _mixed(seed)
    q = max(p.width for p in parts) + extra
    batch = pad_batch(parts, q)
    assert batch.tokens.shape == (len(singles), q) and batch.visible.shape == (len(singles), q, q)
    assert batch.sizes == tuple(t.size for t in singles)
    for r, tree in enumerate(singles):
        _assert_row_is(batch, r, tree)
        _assert_padding(batch, r)
    # Padding twice is padding once to the wider width.
    again = pad_batch([pad_batch(parts[:2], q), pad_batch(parts[2:], q - extra)], q + 1)
    assert torch.equal(again.visible, pad_batch(parts, q + 1).visible)
    assert again.sizes == batch.sizes


def test_pad_batch_and_builders_reject_bad_input():
    parts, _, _ = _mixed(0)
    with pytest.raises(BadParams):
        pad_batch([], 4)
    with pytest.raises(BadParams):
        pad_batch(parts, max(p.width for p in parts) - 1)
    with pytest.raises(BadParams):
        build_trees_device(torch.zeros(2, dtype=torch.long), torch.zeros(3, 2, 4), 4)
    with pytest.raises(BadParams):
        build_trees_device(torch.zeros(2, dtype=torch.long), torch.zeros(2, 4), 4)
    with pytest.raises(BadParams):
        build_trees_device(torch.zeros(2, dtype=torch.long), torch.zeros(2, 2, 4), -1)
    with pytest.raises(BadParams):
        walk_batch(parts[0], torch.zeros(2, 3, dtype=torch.long))


def _posterior_down(tree, leaf, vocab, g, q):
    """Random choices over q nodes, except along the path to `leaf`: each node chooses the next."""
    posterior = torch.randint(0, vocab, (q,), generator=g)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    j = leaf
    while j != 0:
        posterior[parents[j]] = tokens[j]
        j = parents[j]
    return posterior


def _check_walks(batch, singles, posterior):
    order, count = walk_batch(batch, posterior)
    assert order.shape == batch.tokens.shape and count.shape == (batch.batch,)
    fetched = fetch_walks(batch, posterior, order, count)
    for r, tree in enumerate(singles):
        s = tree.size
        mine = posterior[r, :s]
        want_order, want_count = walk_device(tree, mine)
        c = int(count[r])
        assert c == int(want_count)
        assert torch.equal(order[r, :c], want_order[:c])
        assert (order[r, :c] < s).all()                      # padded nodes never accepted
        assert order[r, :c].tolist() == python_walk(tree, mine.tolist())
        _, path_list, new = fetch_walk(tree, mine, want_order, want_count)
        assert fetched[r] == (path_list, new)
    return count


@pytest.mark.parametrize("seed", range(4))
def test_walks_match_the_single_walk(seed):
    parts, singles, vocab = _mixed(seed)
    batch = pad_batch(parts, max(p.width for p in parts) + 2)
    g = torch.Generator().manual_seed(seed)
    # Small choice range: matches happen often, so walks of several steps occur by chance.
    _check_walks(batch, singles, torch.randint(0, vocab, batch.tokens.shape, generator=g))
    _check_walks(batch, singles, torch.zeros_like(batch.tokens))
    # Deep walks: each row's posterior leads to a chosen node, its deepest one or a random one.
    for pick in ("deepest", "random"):
        rows, want = [], []
        for tree in singles:
            depths = tree.depths
            leaf = (int(depths.argmax()) if pick == "deepest"
                    else int(torch.randint(0, tree.size, (1,), generator=g)))
            rows.append(_posterior_down(tree, leaf, vocab, g, batch.width))
            want.append(int(depths[leaf]) + 1)
        count = _check_walks(batch, singles, torch.stack(rows))
        if pick == "deepest":
            assert count.tolist() == want                    # a deepest node has no children
        else:
            assert all(c >= w for c, w in zip(count.tolist(), want))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("b,budget,depth,vocab", [(1, 1, 1, 1), (3, 4, 3, 5), (5, 16, 7, 5), (3, 64, 7, 50)])
def test_unpadded_walks_match(seed, b, budget, depth, vocab):
    logprobs, roots = _batch_logprobs(b, depth, vocab, seed), _roots(b, seed)
    batch = build_trees_device(roots, logprobs, budget)
    singles = [build_tree_device(roots[r], logprobs[r], budget) for r in range(b)]
    g = torch.Generator().manual_seed(seed)
    rows = [_posterior_down(t, int(t.depths.argmax()), vocab, g, batch.width) for t in singles]
    count = _check_walks(batch, singles, torch.stack(rows))
    # The deepest node has no children: the walk ends exactly there.
    assert count.tolist() == [int(t.depths.max()) + 1 for t in singles]


def _code(fn) -> str:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if ast.get_docstring(node) is not None:
        node.body = node.body[1:]
    return ast.unparse(node)


def test_device_functions_read_nothing_back_to_the_host():
    for fn in (build_trees_device, chains_device, roots_only, pad_batch, walk_batch,
               batch_tree.partition_rows, batch_tree.ancestor_rows):
        src = _code(fn)
        for syncing in (".item(", ".tolist(", "nonzero(", "int(", "float(", "bool(", ".cpu(",
                        "torch.tensor(", ".numpy(", "torch.equal(", ".any()", ".all()"):
            assert syncing not in src, (fn.__name__, syncing)
    assert _code(batch_tree.fetch_walks).count(".tolist(") == 1


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_round(roots16, lp16, roots64, lp64, roots_ch, logits, roots_ar, posterior):
    """A mixed batched round on the device: builds, pad, walks; no host value anywhere. The
    given posterior mostly stops at the root; a second one, made on the device, has every node
    choose its first child's token, so that walk goes deep."""
    parts = [build_trees_device(roots16, lp16, 16), build_trees_device(roots64, lp64, 64),
             chains_device(roots_ch, logits), roots_only(roots_ar)]
    batch = pad_batch(parts, posterior.shape[1])
    b, q = batch.tokens.shape
    idx = torch.arange(1, q, device=posterior.device).expand(b, q - 1)
    first = torch.full((b, q), q - 1, device=posterior.device).scatter_reduce(
        1, batch.parents[:, 1:], idx, "amin")
    deep = batch.tokens.gather(1, first).clamp(min=0)       # a choice is never -1
    return batch, posterior, walk_batch(batch, posterior), deep, walk_batch(batch, deep)


def _cuda_inputs(seed, depth=7, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    lp16 = torch.log_softmax(torch.randn(3, depth, vocab, generator=g) * 4, -1)
    lp64 = torch.log_softmax(torch.randn(2, depth, vocab, generator=g) * 4, -1)
    logits = torch.randn(2, depth, vocab, generator=g)
    roots = [torch.randint(0, vocab, (n,), generator=g) for n in (3, 2, 2, 1)]
    posterior = torch.randint(0, vocab, (8, 65), generator=g)
    return [x.cuda() for x in (roots[0], lp16, roots[1], lp64, roots[2], logits, roots[3], posterior)]


@cuda
@pytest.mark.cuda
def test_cuda_round_never_syncs_and_matches_the_single_trees():
    args = _cuda_inputs(0)
    torch.cuda.synchronize()
    _cuda_round(*args)                      # builds the cached layouts before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch, posterior, (order, count), deep, (deep_order, deep_count) = _cuda_round(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    roots16, lp16, roots64, lp64, roots_ch, logits, roots_ar, _ = args
    singles = ([build_tree_device(roots16[i], lp16[i], 16) for i in range(3)]
               + [build_tree_device(roots64[i], lp64[i], 64) for i in range(2)]
               + [chain_of(roots_ch[i], logits[i], "cuda") for i in range(2)]
               + [root_tree(int(roots_ar[0]), "cuda")])
    for r, tree in enumerate(singles):
        # Random fp32 scores: no ties, so the device's topk order cannot tell the rows apart.
        _assert_row_is(batch, r, tree)
        for post, o, c in ((posterior, order, count), (deep, deep_order, deep_count)):
            want_order, want_count = walk_device(tree, post[r, :tree.size])
            assert int(c[r]) == int(want_count)
            assert torch.equal(o[r, :int(c[r])], want_order[:int(want_count)])
    assert int(deep_count[:7].min()) > 2                     # the deep walks did go deep


@cuda
@pytest.mark.cuda
def test_cuda_round_replays_in_a_graph():
    static = _cuda_inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):                  # warm-up: layouts cached, kernels chosen
            _cuda_round(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _cuda_round(*static)
    for seed in (1, 2):
        fresh = _cuda_inputs(seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        want = _cuda_round(*fresh)
        torch.cuda.synchronize()
        assert torch.equal(out[0].tokens, want[0].tokens)
        assert torch.equal(out[0].visible, want[0].visible)
        for walk in (slice(1, 3), slice(3, 5)):
            (post, (o, c)), (post_w, (o_w, c_w)) = out[walk], want[walk]
            assert torch.equal(o, o_w) and torch.equal(c, c_w)
            assert fetch_walks(out[0], post, o, c) == fetch_walks(want[0], post_w, o_w, c_w)
