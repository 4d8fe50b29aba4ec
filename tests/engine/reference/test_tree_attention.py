"""The fused tree-attention kernel (fast/tree_attention.py) against plain float64 attention.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before triton is imported), so these check the kernel code itself on a CPU: the masks, the key
splits and their merge, batch rows of different lengths, and that rows past a row's context and
its new rows are never read. The CUDA tests run the compiled kernels, also inside a CUDA graph
and a compiled function, and the engine's greedy identity with the kernel on.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast import tree_attention as fused
from ddtree.engine.reference.fast.model import choose_attention

from .conftest import make_drafter, make_target


def _runs_here() -> bool:
    if not fused.available():
        return False
    import triton

    # Older interpreters turn a loaded scalar into a 1-element array that numpy 2 refuses as an int.
    version = tuple(int(p) for p in triton.__version__.split(".")[:3] if p.isdigit())
    return torch.cuda.is_available() or (fused.interpreting() and version >= (3, 7, 1))


pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton: CUDA, or its interpreter 3.7.1+")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, keys, values, lengths, tree, scale) -> torch.Tensor:
    """What tree_attention computes, in plain torch and float64."""
    batch, kv_heads, rows, d = keys.shape
    heads = q.shape[1]
    n = q.shape[0] // batch
    groups = heads // kv_heads
    out = torch.empty((batch * n, heads, d), dtype=torch.float64)
    cols = torch.arange(rows)
    for b in range(batch):
        length = int(lengths[b])
        new = tree[b].bool().cpu() if tree is not None else torch.ones(n, n, dtype=torch.bool)
        seen = (cols[None, :] < length).expand(n, rows).clone()
        seen[:, length:length + n] |= new
        for head in range(heads):
            kv = head // groups
            s = q[b * n:(b + 1) * n, head].double().cpu() @ keys[b, kv].double().cpu().T * scale
            s = s.masked_fill(~seen, float("-inf"))
            out[b * n:(b + 1) * n, head] = torch.softmax(s, dim=-1) @ values[b, kv].double().cpu()
    return out


def _case(batch, kv_heads, groups, n, rows, d, dtype, tree_kind, seed, lengths=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch * n, kv_heads * groups, d, generator=g).to(dtype)
    keys = torch.randn(batch, kv_heads, rows, d, generator=g).to(dtype)
    values = torch.randn(batch, kv_heads, rows, d, generator=g).to(dtype)
    if lengths is None:
        lengths = torch.randint(0, rows - n + 1, (batch,), generator=g)
    lengths = torch.as_tensor(lengths)
    tree = None
    if tree_kind == "causal":
        tree = torch.ones(n, n, dtype=torch.bool).tril().expand(batch, n, n)
    elif tree_kind == "random":  # any visibility that includes the diagonal
        tree = (torch.rand(batch, n, n, generator=g) < 0.4) | torch.eye(n, dtype=torch.bool)
    return q, keys, values, lengths, tree


def _on(device, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


def _check(q, keys, values, lengths, tree, *, max_rows=None, tol=None):
    scale = q.shape[-1] ** -0.5
    want = reference(q, keys, values, lengths, tree, scale)
    args = _on(DEVICE, q, keys, values, lengths, tree)
    got = fused.tree_attention(*args, scale, max_rows or keys.shape[2]).cpu()
    assert got.shape == want.shape and got.dtype == q.dtype
    err = ((got.double() - want).norm() / want.norm()).item()
    limit = tol if tol is not None else (1e-5 if q.dtype == torch.float32 else 2e-2)
    assert err < limit, err


@pytest.mark.parametrize("batch, kv_heads, groups, n, rows, d, tree_kind", [
    (1, 2, 2, 1, 300, 64, None),        # an AR step: one query, four key splits
    (1, 2, 2, 17, 300, 64, "random"),   # a tree verify
    (1, 1, 1, 17, 64, 16, "causal"),    # one key block, one split: the kernel normalises itself
    (3, 2, 2, 9, 200, 32, "random"),    # batched rows, each its own length and tree
    (2, 1, 4, 16, 150, 16, None),       # the drafter's block: every new row sees the others
    (1, 2, 8, 33, 520, 32, "random"),   # more folded rows than one query block
])
def test_kernel_equals_float64_attention(batch, kv_heads, groups, n, rows, d, tree_kind):
    _check(*_case(batch, kv_heads, groups, n, rows, d, torch.float32, tree_kind, seed=rows + n))


def test_bf16_within_bf16_rounding():
    _check(*_case(2, 2, 2, 9, 200, 32, torch.bfloat16, "random", seed=3))


@pytest.mark.parametrize("n", [1, 9])
def test_bf16_batched_tiling_within_bf16_rounding(n, monkeypatch):
    """A batch of BATCHED_PAIRS (batch row, kv head) pairs takes the batched tiling: 32-row key
    blocks, a 16-row query block for few rows and 64 for many. Checked here on a small batch by
    lowering the threshold."""
    assert fused.default_config(2, torch.bfloat16, fused.BATCHED_PAIRS).block_n == 32
    assert fused.default_config(2, torch.bfloat16, fused.BATCHED_PAIRS - 1).block_n == 128
    assert fused.default_config(fused.BATCHED_ROWS + 1, torch.bfloat16, fused.BATCHED_PAIRS).block_n == 128
    monkeypatch.setattr(fused, "BATCHED_PAIRS", 4)
    config = fused.default_config(2 * n, torch.bfloat16, 4)
    assert (config.block_m, config.block_n, config.stages) == (16 if n == 1 else 64, 32, 3)
    _check(*_case(2, 2, 2, n, 200, 32, torch.bfloat16, "random", seed=5))


def test_lengths_at_the_edges():
    """An empty context (the new rows see only each other) and a context that fills the buffer."""
    _check(*_case(2, 2, 1, 5, 133, 16, torch.float32, "random", seed=4, lengths=[0, 128]))


def test_rows_past_the_context_and_the_new_rows_are_never_read():
    q, keys, values, lengths, tree = _case(2, 2, 2, 5, 260, 32, torch.float32, "random", seed=6, lengths=[10, 190])
    clean = reference(q, keys, values, lengths, tree, 32 ** -0.5)
    for b, length in enumerate(lengths.tolist()):
        keys[b, :, length + 5:] = float("nan")
        values[b, :, length + 5:] = float("nan")
    got = fused.tree_attention(*_on(DEVICE, q, keys, values, lengths, tree), 32 ** -0.5, 260).cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), clean, rtol=1e-5, atol=1e-6)


def test_slots_pick_the_cache_slot_each_batch_row_reads():
    """A prefill chunk riding in a batched round reads one pool slot, named on the device."""
    q, keys, values, lengths, tree = _case(2, 2, 2, 6, 140, 32, torch.float32, "causal", seed=9, lengths=[40, 7])
    pool_k = torch.randn(5, 2, 140, 32)
    pool_v = torch.randn(5, 2, 140, 32)
    slots = torch.tensor([3, 1])
    pool_k[slots], pool_v[slots] = keys, values
    want = reference(q, keys, values, lengths, tree, 32 ** -0.5)
    got = fused.tree_attention(*_on(DEVICE, q, pool_k, pool_v, lengths, tree), 32 ** -0.5, 140,
                               slots.to(DEVICE)).cpu()
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_the_lengths_are_read_on_the_device_at_every_call():
    q, keys, values, lengths, tree = _on(DEVICE, *_case(1, 1, 2, 3, 200, 16, torch.float32, "causal", seed=7,
                                                          lengths=[20]))
    first = fused.tree_attention(q, keys, values, lengths, tree, 0.25, 200).cpu()
    lengths.fill_(150)  # in place, as a cache's length_t moves under a captured graph
    second = fused.tree_attention(q, keys, values, lengths, tree, 0.25, 200).cpu()
    torch.testing.assert_close(second, reference(q, keys, values, lengths, tree, 0.25).float())
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("splits, fitted", [(9, 2), (9, 9), (5, 1)])
def test_a_short_context_uses_the_fitted_splits_of_a_large_launch(splits, fitted):
    """A launch of 9 key splits whose short rows use 2 (or 1) of them until their length needs
    more at min_blocks a split: the attend kernel and the merge must agree on which splits
    hold blocks. Two rows, one short and one long, in one launch."""
    q, keys, values, lengths, tree = _case(2, 2, 2, 3, 300, 16, torch.float32, "random", seed=splits + fitted,
                                           lengths=[40, 280])
    config = fused.Config(block_m=16, block_n=16, warps=4, stages=2, min_blocks=4)
    got = fused.launch(*_on(DEVICE, q, keys, values, lengths, tree), 0.25, 300, config, splits, fitted).cpu()
    torch.testing.assert_close(got.double(), reference(q, keys, values, lengths, tree, 0.25), rtol=1e-5, atol=1e-6)


def test_a_small_cache_plans_the_splits_of_the_fitted_window(monkeypatch):
    """The split count the default tiling was fitted with (an 8256-row cache) holds for smaller
    caches too: planned on its own rows, a 1,664-row cache gave an AR step 2 splits."""
    monkeypatch.setattr(fused, "_multiprocessors", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    fitted = fused.plan_splits(8, 1, 8256, cuda, 128, 8)
    assert fitted == 9
    assert fused.plan_splits(8, 1, 1664, cuda, 128, 8) == fitted
    assert fused.plan_splits(8, 1, 40960, cuda, 128, 8) == 33  # a larger cache: two programs a multiprocessor


def test_choose_attention_names_what_runs():
    assert choose_attention("triton", torch.device(DEVICE), 64) == "triton"
    assert choose_attention("auto", torch.device("cpu"), 64) == "sdpa"  # the interpreter is for tests only
    with pytest.raises(BadParams, match="triton"):
        choose_attention("triton", torch.device(DEVICE), 48)  # not a power of two
    with pytest.raises(BadParams, match="attention must be"):
        choose_attention("flash", torch.device("cpu"), 64)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 7),
                                  SpecParams("ddtree", 40)])
def test_static_path_with_the_kernel_decodes_what_the_eager_path_decodes(spec):
    """Greedy output, token for token, and accept lengths, round for round: the static path (what
    the graphs capture) with tree attention in the target and the drafter, against the eager path."""
    model = make_target(27).to(DEVICE)
    drafter = make_drafter(model, block_size=8, seed=8).to(DEVICE)
    eager = Engine(model, drafter, backend="fast", max_budget=64, attention="matmul", graphs=False)
    fast = Engine(model, drafter, backend="fast", max_budget=64, attention="triton", graphs=False)
    fast.target.static = True
    assert fast.target.attention == "triton" and fast.impl.drafts.attention == "triton"
    gen = GenParams(max_new_tokens=10, ignore_eos=True)
    for prompt in ([5], list(range(3, 30))):
        want = eager.generate(prompt, gen, spec)
        got = fast.generate(prompt, gen, spec)
        assert got.output_ids == want.output_ids
        assert got.accept_lengths == want.accept_lengths


# ---- CUDA: the compiled kernels ------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, kv_heads, groups, n, rows, d", [
    (1, 8, 4, 1, 1280, 128), (1, 8, 4, 65, 1280, 128), (1, 8, 2, 257, 2304, 128),
    (16, 8, 2, 17, 1024, 128), (1, 2, 2, 16, 1041, 64)])
def test_cuda_kernel_at_real_shapes(dtype, batch, kv_heads, groups, n, rows, d):
    """The 8B shape's AR step and verifies of 65 and 257 nodes, a batch of 16 trees, the demo
    drafter's block."""
    _check(*_case(batch, kv_heads, groups, n, rows, d, dtype, "random", seed=n))


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_and_compile_replay_at_new_lengths():
    q, keys, values, lengths, tree = _on("cuda", *_case(1, 4, 2, 9, 700, 64, torch.bfloat16, "random", seed=9,
                                                         lengths=[100]))

    def run(q):
        return fused.tree_attention(q, keys, values, lengths, tree, 0.125, 700) * 2

    compiled = torch.compile(run, fullgraph=True)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            out.copy_(compiled(q))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(compiled(q))
    for length in (100, 5, 690):
        lengths.fill_(length)
        graph.replay()
        want = reference(q, keys, values, lengths, tree, 0.125) * 2
        err = ((out.cpu().double() - want).norm() / want.norm()).item()
        assert err < 2e-2, (length, err)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="its reference drafts on the CPU; on CUDA test_cuda_fast's "
                    "graphed identity checks cover the drafter's kernel")
def test_drafter_static_block_with_the_kernel_equals_the_reference():
    """The drafter's block on its static path (the one its graphs capture) reads its context
    length on the device through the kernel: the same drafts as the transformers-style reference."""
    from .test_fast_draft import TOL, _run_pair, _tiny

    target, drafter, feats = _tiny()
    got, want = _run_pair(target, drafter, feats, static=True, attention="triton")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("static, riding", [(False, False), (True, False), (True, True)],
                         ids=["batched", "batched-static", "batched-static-riding"])
def test_pooled_rounds_with_the_kernel_equal_serial(static, riding, monkeypatch):
    """Batched rounds over the KV pool, each row masked by its own length and tree inside the
    kernel (the target's verify and the drafter's block), with sessions joining and leaving;
    riding: new prompts' chunks in the rounds, their attention through the kernel's slot index."""
    import random

    from .test_fast_pool import _drive

    batches, indexed = [], []
    real = fused.tree_attention

    def counted(q, keys, *args):
        batches.append(keys.shape[0])
        if len(args) > 5 and args[5] is not None:
            indexed.append(q.shape[0])
        return real(q, keys, *args)
    monkeypatch.setattr(fused, "tree_attention", counted)

    model = make_target(0).to(DEVICE)
    drafter = make_drafter(model, block_size=8, seed=1).to(DEVICE)
    serial = Engine(model, drafter, backend="fast", max_budget=16, attention="matmul", graphs=False)
    pooled = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=4, attention="triton", graphs=False)
    pooled.impl.batch_static = static
    if riding:
        pooled.prefill_chunk, pooled.mixed_chunk = 4, True
    rng = random.Random(4)
    specs = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 5), SpecParams("ddtree", 16)]
    spec_of = (lambda i: specs[i % 4]) if not static else (lambda i: specs[3])
    # Few and short: Triton's interpreter runs every kernel call in Python (on a loaded 2-core
    # box, 8 jobs of up to 11 tokens took 330-350 s a case).
    jobs = [([rng.randrange(64) for _ in range(rng.randrange(1, 14))], spec_of(i), rng.randrange(1, 8))
            for i in range(6)]
    want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    got, _ = _drive(pooled, jobs, running=4)
    assert [got[j] for j in range(len(jobs))] == want
    assert len(pooled.impl._free) == pooled.impl.pool.slots
    assert max(batches) > 1  # the kernel really served batched rows
    assert bool(indexed) == riding
