"""FastDrafter against DFlashDrafter + DraftCache, fed the same rounds and the full trained block."""

from pathlib import Path

import pytest
import torch

from ddtree.engine.reference.drafter import context_features, load_drafter
from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast.draft import FastDrafter, default_buckets

from .conftest import make_drafter, make_target

DEMO = Path(__file__).resolve().parents[3] / "assets" / "demo"
ROUNDS = (11, 3, 1, 5, 8, 2)  # pending rows per round: a whole prompt first, then accepted runs
TOL = dict(atol=1e-4, rtol=1e-4)


class Reference:
    """What Session._draft computes, with the drafter's trained block size."""

    def __init__(self, drafter, embed, lm_head, mask_token_id):
        self.drafter, self.embed, self.lm_head, self.mask = drafter, embed, lm_head, mask_token_id
        self.cache = drafter.new_cache()

    @torch.no_grad()
    def draft(self, bonus: int, start: int, pending: torch.Tensor, depth: int) -> torch.Tensor:
        b = self.drafter.block_size
        block = torch.full((b,), self.mask, dtype=torch.long)
        block[0] = bonus
        positions = torch.arange(self.cache.get_seq_length(), start + b)
        hidden = self.drafter(self.embed(block)[None], pending[None], positions[None], None, self.cache)
        return self.lm_head(hidden[0, 1:1 + depth]).float()


def _tiny():
    target = make_target(3)
    drafter = make_drafter(target, block_size=8, layers=3)
    width = drafter.fc.weight.shape[1]
    feats = torch.randn(sum(ROUNDS), width, generator=torch.Generator().manual_seed(5))
    return target, drafter, feats


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    drafter = load_drafter(DEMO / "drafter", dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(4, target.config.vocab_size, (1, sum(ROUNDS)), generator=gen)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return target, drafter, context_features(out.hidden_states, drafter.target_layer_ids)[0]


def _rounds(feats: torch.Tensor, vocab: int):
    """(bonus, start, pending) per round; the pending rows cover length..start-1."""
    gen = torch.Generator().manual_seed(9)
    start = 0
    for p in ROUNDS:
        pending = feats[start:start + p]
        start += p
        yield int(torch.randint(vocab, (1,), generator=gen)), start, pending


def swap_every_linear(fast: FastDrafter, rows=range(1, 17)) -> None:
    """Make RowLinears take the swapped product for every shape of up to 16 rows (the most it
    swaps) that the drafter can meet; on a CPU it never chooses that by itself."""
    linears = [m for m in fast.drafter.modules() if isinstance(m, torch.nn.Linear)] + [fast.lm_head]
    fast.linear.swap = {(m, *lin.weight.shape[::-1]) for lin in linears for m in rows}


def kernel_for_every_linear(fast: FastDrafter, rows=range(2, 65)) -> None:
    """Make RowLinears take the few-row kernel (fast/gemv.py) for every shape of 2..64 rows the
    drafter can meet; on a CPU it never chooses that by itself."""
    from ddtree.engine.reference.fast.gemv import RowsConfig

    linears = [m for m in fast.drafter.modules() if isinstance(m, torch.nn.Linear)] + [fast.lm_head]
    linears += [j for joins in fast.joins for j in (joins.qkv, joins.kv, joins.gate_up)]
    fast.linear.kernel = {(m, *lin.weight.shape[::-1]): RowsConfig(16, 16, 32, 4) for lin in linears for m in rows}


def _run_pair(target, drafter, feats, *, static: bool, tensor_bonus: bool = False, buckets=(1, 2, 4, 8),
              attention: str = "auto", swapped: bool = False, kernel: bool = False):
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    mask = drafter.mask_token_id if drafter.mask_token_id is not None else target.config.vocab_size - 1
    fast = FastDrafter(drafter, embed, head, capacity=64, mask_token_id=mask, attention=attention)
    if swapped:
        swap_every_linear(fast)
    if kernel:
        kernel_for_every_linear(fast)
    cache = fast.new_cache(append_buckets=buckets if static else None)
    ref = Reference(drafter, embed, head, mask)
    depth = drafter.block_size - 1
    got, want = [], []
    for bonus, start, pending in _rounds(feats, target.config.vocab_size):
        b = torch.tensor([bonus]) if tensor_bonus else bonus
        got.append(fast.draft(b, start, pending, cache, depth).clone())
        want.append(ref.draft(bonus, start, pending, depth))
        assert cache.seq_length() == start == ref.cache.get_seq_length()
        assert int(cache.length_t) == start
    return got, want


@pytest.mark.parametrize("static", [False, True])
def test_tiny_drafter_equals_reference(tiny, static):
    target, drafter, feats = tiny
    got, want = _run_pair(target, drafter, feats, static=static)
    assert len(got) == len(ROUNDS) >= 4
    for g, w in zip(got, want):
        assert g.shape == w.shape == (drafter.block_size - 1, target.config.vocab_size)
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("attention, swapped", [("matmul", False), ("sdpa", True), ("matmul", True)])
def test_matmul_attention_and_swapped_linears_equal_reference(tiny, static, attention, swapped, monkeypatch):
    """The CUDA choices (two GEMMs around a float32 softmax; few-row products with the operands
    swapped), forced on the CPU: the same drafts as the reference, and the swaps really taken,
    for weights that are not square too (a mixed-up in/out would miss or fail those)."""
    from ddtree.engine.reference.fast import rows

    taken = []
    original = rows._swapped

    def counting(x, weight, bias):
        taken.append(tuple(weight.shape))
        return original(x, weight, bias)
    monkeypatch.setattr(rows, "_swapped", counting)
    target, drafter, feats = tiny
    got, want = _run_pair(target, drafter, feats, static=static, attention=attention, swapped=swapped)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    if swapped:
        assert any(n != k for n, k in taken) and any(n == k for n, k in taken)
    else:
        assert taken == []


@pytest.mark.parametrize("static", [False, True])
def test_few_row_kernel_linears_equal_reference(tiny, static, monkeypatch):
    """Every few-row product of the drafter on the few-row kernel (Triton's interpreter here):
    the same drafts as the reference, and the kernel really taken, at several row counts."""
    from ddtree.engine.reference.fast import gemv
    from ddtree.engine.reference.fast import tree_attention

    from .test_tree_attention import _runs_here

    if not (_runs_here() and tree_attention.interpreting()):  # the fixture's tensors are on the CPU
        pytest.skip("needs Triton's interpreter 3.7.1+ (test_cuda_rows.py has the CUDA side)")
    seen = []
    original = gemv.launch_rows
    monkeypatch.setattr(gemv, "launch_rows",
                        lambda x, w, *a, **k: seen.append((x.shape[0], tuple(w.shape))) or original(x, w, *a, **k))
    target, drafter, feats = tiny
    got, want = _run_pair(target, drafter, feats, static=static, kernel=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert len({m for m, _ in seen}) >= 2
    attn, mlp = drafter.layers[0].self_attn, drafter.layers[0].mlp
    width = attn.q_proj.weight.shape[1]
    joined = {(sum(lin.weight.shape[0] for lin in (attn.q_proj, attn.k_proj, attn.v_proj)), width),
              (mlp.gate_proj.weight.shape[0] + mlp.up_proj.weight.shape[0], width)}
    assert joined <= {shape for _, shape in seen}  # the joined products took it too


def test_a_cpu_drafter_takes_sdpa_and_plain_linears_and_rejects_a_bad_attention(tiny):
    target, drafter, _ = tiny
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    fast = FastDrafter(drafter, embed, head, capacity=16, mask_token_id=5)
    assert fast.attention == "sdpa" and not fast.linear.active
    fast.tune((1, 2, 4, 8))  # nothing to measure off CUDA
    assert fast.linear.swap == set() and fast.linear.measured == {}
    with pytest.raises(BadParams, match="attention"):
        FastDrafter(drafter, embed, head, capacity=16, mask_token_id=5, attention="flash")


def test_demo_pair_equals_reference(demo):
    target, drafter, feats = demo
    assert drafter.block_size == 16
    for static in (False, True):
        got, want = _run_pair(target, drafter, feats, static=static, buckets=(4, 16))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)


def test_static_path_equals_eager_and_bonus_kinds_agree(tiny):
    target, drafter, feats = tiny
    eager, _ = _run_pair(target, drafter, feats, static=False)
    # Buckets (2, 4): a 1-row append pads to 2, 3 to 4, and 11, 5 and 8 exceed them and run eager.
    static, _ = _run_pair(target, drafter, feats, static=True, buckets=(2, 4))
    static_t, _ = _run_pair(target, drafter, feats, static=True, tensor_bonus=True, buckets=(2, 4))
    eager_t, _ = _run_pair(target, drafter, feats, static=False, tensor_bonus=True)
    for e, s, st, et in zip(eager, static, static_t, eager_t):
        torch.testing.assert_close(s, e, atol=1e-5, rtol=1e-5)
        assert torch.equal(st, s) and torch.equal(et, e)


def test_block_reads_only_the_context(tiny):
    """Rows past length (pad rows, an old block, garbage) never change a draft."""
    target, drafter, feats = tiny
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    fast = FastDrafter(drafter, embed, head, capacity=32, mask_token_id=5)
    for buckets in (None, (16,)):
        cache = fast.new_cache(append_buckets=buckets)
        fast.append(feats[:7], cache)
        first = fast.block(3, 7, cache).clone()
        cache.keys[:, :, 7:].normal_()
        cache.values[:, :, 7:].normal_()
        torch.testing.assert_close(fast.block(3, 7, cache), first, atol=0, rtol=0)
        cache.reset()
        assert cache.seq_length() == 0 and int(cache.length_t) == 0
        fast.append(feats[:7], cache)
        torch.testing.assert_close(fast.block(3, 7, cache), first, atol=1e-6, rtol=1e-6)


def test_cache_shapes_and_errors(tiny):
    target, drafter, feats = tiny
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    fast = FastDrafter(drafter, embed, head, capacity=10, mask_token_id=5)
    cache = fast.new_cache()
    cfg = drafter.config
    assert cache.keys.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, 10 + 8 + 1, cfg.head_dim)
    assert cache.nbytes() == 2 * cache.keys.numel() * 4
    fast.append(feats[:0], cache)
    assert cache.seq_length() == 0
    with pytest.raises(BadParams, match="capacity"):
        fast.append(feats[:11], cache)
    with pytest.raises(BadParams, match="pending"):
        fast.append(feats[:3, :5], cache)
    with pytest.raises(BadParams, match="depth"):
        fast.draft(1, 3, feats[:3], cache, 8)
    with pytest.raises(BadParams, match="one token"):
        fast.block(torch.tensor([1, 2]), 0, cache)
    with pytest.raises(BadParams, match="buckets"):
        fast.new_cache(append_buckets=(0, 4))
    with pytest.raises(BadParams, match="capacity"):
        FastDrafter(drafter, embed, head, capacity=0, mask_token_id=5)
    if not torch.cuda.is_available():
        with pytest.raises(BadParams, match="CUDA"):
            fast.capture(cache)
    assert default_buckets(16) == (1, 2, 4, 8, 16) and default_buckets(6) == (1, 2, 4, 6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager(dtype):
    target = make_target(3).to("cuda", dtype)
    drafter = make_drafter(target, block_size=8, layers=3).to("cuda", dtype)
    feats = torch.randn(sum(ROUNDS), drafter.fc.weight.shape[1], device="cuda", dtype=dtype)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    fast = FastDrafter(drafter, embed, head, capacity=64, mask_token_id=5)
    eager, graphed = fast.new_cache(), fast.new_cache()
    fast.capture(graphed)
    assert graphed.graphs is not None and set(graphed.graphs.appends) == {1, 2, 4, 8}
    assert graphed.seq_length() == 0 and int(graphed.length_t) == 0
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    for bonus, start, pending in _rounds(feats, target.config.vocab_size):
        want = fast.draft(bonus, start, pending, eager, 7)
        bonus_t = torch.tensor([bonus], device="cuda")
        got = fast.draft(bonus_t, start, pending, graphed, 7)
        torch.testing.assert_close(got, want, **tol)
        assert int(graphed.length_t) == graphed.seq_length() == start


def test_a_layer_runs_four_products_in_the_block_and_one_in_the_context_step(tiny):
    """q/k/v joined and gate/up joined (the drafter's weights become views of the joined ones):
    a block forward makes 4 products a layer plus the head, a context step fc plus 1 a layer,
    and the drafter's own modules still compute what they did."""
    from ddtree.engine.reference.fast.rows import RowLinears

    target, _, feats = tiny
    drafter = make_drafter(target, block_size=8, layers=3, seed=11)
    x = torch.randn(5, drafter.config.hidden_size)
    attn, mlp = drafter.layers[1].self_attn, drafter.layers[1].mlp
    before = [lin(x) for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    fast = FastDrafter(drafter, embed, head, capacity=64, mask_token_id=drafter.config.vocab_size - 1)
    for lin, want in zip((attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj), before):
        torch.testing.assert_close(lin(x), want)
    joins = fast.joins[1]
    assert attn.k_proj.weight.data_ptr() == joins.kv.weight.data_ptr()  # views, not copies
    calls = []
    real = RowLinears.__call__
    fast.linear = type("Counting", (RowLinears,), {
        "__call__": lambda self, module, rows: calls.append(tuple(module.weight.shape)) or real(self, module, rows)})(
        fast.device, fast.dtype)
    cache = fast.new_cache()
    fast.draft(3, 11, feats[:11], cache, drafter.block_size - 1)
    layers = drafter.config.num_hidden_layers
    assert len(calls) == (1 + layers) + (4 * layers + 1)


def test_two_fast_drafters_on_one_drafter_share_its_joined_weights(tiny):
    """A second fast drafter (a second engine on the same drafter object) reuses the first's
    joined products, whose views the drafter's weights are, rather than joining copies; after a
    module.to() the views are gone and it joins afresh."""
    target, _, _ = tiny
    drafter = make_drafter(target, block_size=8, layers=2, seed=12)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    mask = drafter.config.vocab_size - 1
    first = FastDrafter(drafter, embed, head, capacity=64, mask_token_id=mask)
    second = FastDrafter(drafter, embed, head, capacity=64, mask_token_id=mask)
    for a, b, layer in zip(first.joins, second.joins, drafter.layers):
        assert a is b
        assert layer.self_attn.q_proj.weight.data_ptr() == b.qkv.weight.data_ptr()
        assert layer.mlp.up_proj.weight.data_ptr() == b.gate_up.weight.data_ptr() + \
            layer.mlp.gate_proj.weight.numel() * b.gate_up.weight.element_size()
    drafter.to(torch.float64)
    third = FastDrafter(drafter, embed.to(torch.float64), head.to(torch.float64), capacity=64, mask_token_id=mask)
    assert third.joins[0] is not first.joins[0] and third.joins[0].qkv.weight.dtype == torch.float64
    attn = drafter.layers[0].self_attn
    assert attn.v_proj.weight.data_ptr() == third.joins[0].kv.weight.data_ptr() + \
        attn.k_proj.weight.numel() * 8
    # Nothing but the fast drafters keeps joins alive: none rides on the drafter's modules.
    import gc
    import weakref

    gone = weakref.ref(third.joins[1])
    del first, second, third
    gc.collect()
    assert gone() is None
