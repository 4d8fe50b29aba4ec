"""The one-row product kernel (fast/gemv.py) against F.linear, and the engine with every one-row
product on it. Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py); on the
H200 the CUDA test below runs the tune and every tiling compiled, and test_cuda_fast.py's graphed
decodes run it wherever the tune kept it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast import gemv as gemv_module
from ddtree.engine.reference.fast.gemv import CONFIGS, Config, Gemv, RowsConfig, launch, launch_rows, rows_configs

from .conftest import make_drafter, make_target
from .test_tree_attention import _runs_here

pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton: CUDA, or its interpreter 3.7.1+")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(n, k, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("n,k,config,bias", [
    (64, 512, CONFIGS[0], False), (48, 1024, CONFIGS[-1], True),     # even: no masks
    (37, 100, Config(8, 32, 4, 2), True), (5, 33, Config(4, 64, 4, 2), False)])  # ragged N and K
def test_kernel_equals_the_product(n, k, config, bias):
    x, w, b = _case(n, k, torch.float32, bias, n + k)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = launch(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), config).cpu()
    assert got.shape == (1, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bf16_within_bf16_rounding():
    x, w, b = (t.to(torch.bfloat16) for t in _case(96, 512, torch.bfloat16, True, 3))
    want = F.linear(x.double(), w.double(), b.double())
    got = launch(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), Config(16, 256, 4, 2)).cpu()
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, atol=2e-2, rtol=1e-2)


def test_only_one_row_of_a_picked_shape_takes_the_kernel(monkeypatch):
    x, w, _ = _case(32, 64, torch.float32, False, 5)
    gemv = Gemv()
    assert gemv.takes(x, w) is None  # nothing picked: F.linear everywhere
    gemv.picked[(32, 64)] = Config(8, 32, 4, 2)
    assert gemv.takes(x, w) == Config(8, 32, 4, 2)
    assert gemv.takes(torch.cat([x, x]), w) is None
    assert gemv.takes(x[:, :16], w[:8, :16]) is None
    calls = []
    real = gemv_module.launch
    monkeypatch.setattr(gemv_module, "launch", lambda *a: calls.append(a[3]) or real(*a))
    x2, w2 = x.to(DEVICE), w.to(DEVICE)
    assert torch.allclose(gemv(x2, w2), F.linear(x2, w2), atol=1e-5)
    assert calls == [Config(8, 32, 4, 2)]
    gemv(torch.cat([x2, x2]), w2)
    gemv.enabled = False  # what use_kernels(False) sets: F.linear even for a picked shape
    gemv(x2, w2)
    assert len(calls) == 1


@pytest.mark.parametrize("k, config", [(96, Config(8, 32, 4, 2)), (100, Config(4, 64, 4, 2))], ids=["even", "ragged"])
@pytest.mark.parametrize("fold", ["rms", "silu", "residual", "silu+residual"])
def test_what_a_product_folds_in_equals_the_torch_ops(fold, k, config, monkeypatch):
    """The input layer norm (before q/k/v), the activation (before down) and the residual add
    (after o and down), folded into the kernel, against the same ops in torch (`plain`)."""
    from ddtree.engine.reference.fast.gemv import plain
    from ddtree.engine.reference.fast.model import RMSNorm

    x, w, b = _case(40, k, torch.float32, True, k)
    g = torch.Generator().manual_seed(1)
    pre = None
    if "rms" in fold:
        pre = RMSNorm(k, 1e-6)
        pre.weight.data = torch.randn(k, generator=g)
        x = x * 3
    elif "silu" in fold:
        pre, x = "silu", torch.randn(1, 2 * k, generator=g)
    residual = torch.randn(1, 40, generator=g) if "residual" in fold else None
    gemv = Gemv()
    gemv.picked[(40, k)] = config
    want = plain(x, w, b, pre, residual)
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, w, b, pre, residual)]
    if isinstance(pre, torch.nn.Module):
        args[3] = pre.to(DEVICE)
    codes = []
    real = gemv_module.launch
    monkeypatch.setattr(gemv_module, "launch", lambda *a: codes.append((a[4], a[5] is not None)) or real(*a))
    got = gemv(*args).cpu()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert codes == [({"rms": 2, "silu": 1}.get(fold.split("+")[0], 0), residual is not None)]  # folded: one launch
    gemv.folds = False  # what bench_fast --folds-off-too sets: the same result, the ops around the kernel
    assert torch.allclose(gemv(*args).cpu(), want, atol=1e-5, rtol=1e-5)
    assert codes[1:] == [(0, False)]  # the bare product on the kernel
    assert gemv.takes(x, w, pre) == config
    assert gemv.takes(x, w, "gelu") is None  # only silu folds; gelu takes the torch ops
    assert gemv.takes(x[:, :k], w, torch.nn.LayerNorm(k)) is None  # a mean and a bias: not the prologue's


def test_tune_measures_nothing_off_cuda():
    gemv = Gemv()
    gemv.tune([[(torch.randn(8, 16), None)]])
    gemv.tune_rows([[(torch.randn(8, 16), None)]], [2, 17])
    assert gemv.measured == {} and gemv.picked == {} and gemv.measured_rows == {} and gemv.picked_rows == {}


# ---- few rows (a one-session verify, the drafter's block) ----------------------------------
@pytest.mark.parametrize("m,n,k,config,bias", [
    (2, 64, 512, RowsConfig(16, 64, 64, 4), False), (17, 48, 256, RowsConfig(32, 32, 64, 4), True),
    (65, 37, 100, RowsConfig(64, 16, 32, 4), True), (65, 40, 96, RowsConfig(16, 32, 64, 4), False),  # 5 row tiles
    (3, 5, 33, RowsConfig(16, 16, 32, 4), True),  # ragged N and K
    (40, 150, 130, RowsConfig(64, 128, 64, 8, 3), True),  # a wide tile (WIDE_TILES), ragged
    # the elementwise kernel (FMA_TILES): row tiles past m, ragged N and K, K over several steps
    (17, 48, 256, RowsConfig(8, 8, 64, 4, fma=True), True), (3, 5, 33, RowsConfig(4, 4, 16, 4, fma=True), True),
    (9, 37, 300, RowsConfig(4, 8, 128, 4, fma=True), False)])
def test_rows_kernel_equals_the_product(m, n, k, config, bias):
    x, w, b = _case(n, k, torch.float32, bias, n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = launch_rows(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), config).cpu()
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    # Rows that are a slice of a wider tensor (a block's hidden[1:]) read with their stride.
    wide = torch.randn(m + 1, k + 7)
    got = launch_rows(wide[1:, :k].to(DEVICE), w.to(DEVICE), None, config).cpu()
    assert torch.allclose(got.double(), F.linear(wide[1:, :k].double(), w.double()), atol=1e-5, rtol=1e-5)


def test_rows_configs_cover_the_rows_with_at_most_two_row_tiles():
    assert {c.block_m for c in rows_configs(2)} == {16}
    assert {c.block_m for c in rows_configs(17)} == {16, 32}
    assert {c.block_m for c in rows_configs(65)} == {16, 64}
    assert all(c.block_n * c.block_k <= 64 * 64 for c in rows_configs(128))
    # The wide tiles: only when asked, only at a verify's rows, on the covering row tile.
    assert rows_configs(17, wide=True) == rows_configs(17)
    extra = set(rows_configs(65, wide=True)) - set(rows_configs(65))
    assert len(extra) == 3 and {c.block_m for c in extra} == {64} and {c.stages for c in extra} >= {3, 4}
    # The elementwise tiles: only when asked, at every row count, each with 8192 partial sums.
    assert not any(c.fma for c in rows_configs(17, wide=True))
    fma = set(rows_configs(2, fma=True)) - set(rows_configs(2))
    assert len(fma) == 4 and all(c.fma and c.block_m * c.block_n * c.block_k == 8192 for c in fma)


def test_the_row_tune_skips_a_tiling_that_does_not_run_and_tries_wide_ones_only_when_asked(monkeypatch):
    """A tiling past a GPU's shared memory fails in Triton's compile (in the timing's warm-up):
    the tune leaves it out and picks among the rest; wide tiles are tried for 2-byte weights only
    when Gemv.wide_rows is on, the elementwise ones for 4-byte weights. (The tune's timing is
    faked here: no GPU.)"""
    from ddtree.engine.reference.fast.gemv import FMA_TILES, WIDE_TILES

    monkeypatch.setattr(gemv_module, "_tunable", lambda weight: True)
    tried = []

    def fake_replay(fn, device, launches):
        fn()
        return 100.0 if not tried or tried[-1] is None else tried[-1]

    def fake_launch(x, w, b, config, *args):
        if config.block_n == WIDE_TILES[0][0] and config.block_k == WIDE_TILES[0][1]:
            raise RuntimeError("out of resource: shared memory")
        tried.append(50.0 if config.stages > 2 else 90.0)
        return None

    monkeypatch.setattr(gemv_module, "replay_us", fake_replay)
    monkeypatch.setattr(gemv_module, "launch_rows", fake_launch)
    monkeypatch.setattr(gemv_module, "plain", lambda *a: tried.append(None))
    for dtype, wide in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)):
        gemv = Gemv()
        gemv.wide_rows = wide
        tried.clear()
        gemv.tune_rows([[(torch.zeros(64, 32, dtype=dtype), None)]], [65])
        times = gemv.measured_rows[(65, 64, 32)]
        extra = (2 if wide and dtype == torch.bfloat16 else 0) + (len(FMA_TILES) if dtype == torch.float32 else 0)
        assert len(times) == 1 + len(rows_configs(65)) + extra
        assert (gemv.picked_rows[(65, 64, 32)].stages > 2) == (wide and dtype == torch.bfloat16)


@pytest.mark.parametrize("fma", [False, True], ids=["dot", "fma"])
@pytest.mark.parametrize("fold", ["rms", "silu+residual", "residual"])
def test_few_row_folds_equal_the_torch_ops(fold, fma, monkeypatch):
    """The folds of the one-row kernel, per row, on the few-row kernel: an RMSNorm over each row,
    silu(gate) * up, the residual add, against the torch ops (`plain`), in one launch."""
    from ddtree.engine.reference.fast.gemv import plain
    from ddtree.engine.reference.fast.model import RMSNorm

    m, n, k = 9, 40, 96
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    pre, x = None, torch.randn(m, k, generator=g) * torch.arange(1, m + 1)[:, None]  # rows of other scales
    if fold == "rms":
        pre = RMSNorm(k, 1e-6)
        pre.weight.data = torch.randn(k, generator=g)
    elif "silu" in fold:
        pre, x = "silu", torch.randn(m, 2 * k, generator=g)
    residual = torch.randn(m, n, generator=g) if "residual" in fold else None
    gemv = Gemv()
    gemv.picked_rows[(m, n, k)] = RowsConfig(4, 8, 32, 4, fma=True) if fma else RowsConfig(16, 16, 32, 4)
    want = plain(x, w, b, pre, residual)
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, w, b, pre, residual)]
    if isinstance(pre, torch.nn.Module):
        args[3] = pre.to(DEVICE)
    codes = []
    real = gemv_module.launch_rows
    monkeypatch.setattr(gemv_module, "launch_rows", lambda *a: codes.append((a[4], a[5] is not None)) or real(*a))
    assert torch.allclose(gemv(*args).cpu(), want, atol=1e-5, rtol=1e-5)
    assert codes == [({"rms": 2, "silu": 1}.get(fold.split("+")[0], 0), residual is not None)]


def test_only_the_tuned_row_counts_take_the_rows_kernel():
    gemv = Gemv()
    w = torch.randn(32, 64)
    gemv.picked_rows[(17, 32, 64)] = RowsConfig(16, 16, 32, 4)
    assert gemv.takes(torch.randn(17, 64), w) == RowsConfig(16, 16, 32, 4)
    assert gemv.takes(torch.randn(16, 64), w) is None and gemv.takes(torch.randn(1, 64), w) is None
    assert gemv.takes(torch.randn(17, 64), w, "gelu") is None
    gemv.enabled = False
    assert gemv.takes(torch.randn(17, 64), w) is None


def _static_and_eager(target_seed: int, drafter_seed: int):
    """(the eager fast engine, the static one on the triton kernel, the weight shapes of the
    target's products: q/k/v, o, gate/up, down, the head) on one tiny pair."""
    model = make_target(target_seed).to(DEVICE)
    drafter = make_drafter(model, block_size=6, seed=drafter_seed).to(DEVICE)
    eager = Engine(model, drafter, backend="fast", max_budget=16, graphs=False)
    fast = Engine(model, drafter, backend="fast", max_budget=16, attention="triton", graphs=False)
    fast.target.static = True
    decoder = fast.target.model
    layer = decoder.model.layers[0]
    shapes = {tuple(w.shape) for w in (layer.self_attn.qkv[0], layer.self_attn.o_proj.weight,
                                       layer.mlp.gate_up[0], layer.mlp.down_proj.weight, decoder.lm_head.weight)}
    return eager, fast, shapes


@pytest.mark.slow
def test_static_path_with_one_row_products_on_the_kernel_decodes_the_same(monkeypatch):
    """Greedy AR output, token for token: the static path with every one-row product of the target
    (q/k/v, o, gate/up, down, the head) on the kernel, against the eager path without it."""
    eager, fast, shapes = _static_and_eager(31, 4)
    decoder = fast.target.model
    for shape in shapes:
        decoder.gemv.picked[shape] = Config(4, 32, 4, 2)
    calls = []
    real = gemv_module.launch
    monkeypatch.setattr(gemv_module, "launch", lambda *a: calls.append(tuple(a[1].shape)) or real(*a))
    gen = GenParams(max_new_tokens=8, ignore_eos=True)
    for prompt in ([7], list(range(3, 25))):
        want = eager.generate(prompt, gen, SpecParams("ar")).output_ids
        assert fast.generate(prompt, gen, SpecParams("ar")).output_ids == want
    assert set(calls) == shapes


@pytest.mark.slow
@pytest.mark.parametrize("config", [RowsConfig(16, 32, 32, 4), RowsConfig(16, 32, 32, 4, fma=True)], ids=["dot", "fma"])
def test_static_path_with_few_row_products_on_the_kernel_decodes_the_same(config, monkeypatch):
    """Greedy DDTree and DFlash output, token for token: the static path with every product of
    the target's verify (q/k/v, o, gate/up, down, the head, at every query bucket) on the
    few-row kernel, against plain AR on the eager path."""
    eager, fast, shapes = _static_and_eager(32, 5)
    decoder = fast.target.model
    for m in fast.target.buckets[1:]:
        for shape in shapes:
            decoder.gemv.picked_rows[(m, *shape)] = config
    rows = []
    real = gemv_module.launch_rows
    monkeypatch.setattr(gemv_module, "launch_rows", lambda *a: rows.append(a[0].shape[0]) or real(*a))
    gen = GenParams(max_new_tokens=10, ignore_eos=True)
    for prompt in ([7], list(range(3, 25))):
        want = eager.generate(prompt, gen, SpecParams("ar")).output_ids
        for spec in (SpecParams("dflash"), SpecParams("ddtree", 16), SpecParams("ddtree", 3)):
            assert fast.generate(prompt, gen, spec).output_ids == want, spec
    assert len(set(rows)) >= 2 and max(rows) > 8  # chains and trees of several buckets took it


# ---- CUDA: the compiled kernel and the tune ------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tune_over_real_shapes_and_every_tiling():
    """The Qwen3-8B layer's one-row shapes in bf16: the tune measures each over all its weights
    (as CUDA graph replays), and every tiling it may pick computes the product."""
    from ddtree.engine.reference.fast.rows import replay_us

    shapes = [(6144, 4096), (4096, 4096), (4096, 12288)]
    g = torch.Generator(device="cuda").manual_seed(0)
    groups = [[(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5, None)
               for _ in range(3)] for n, k in shapes]
    gemv = Gemv()
    gemv.tune(groups)
    assert set(gemv.measured) == set(shapes)
    for key, times in gemv.measured.items():
        assert len(times) == 1 + len(CONFIGS) and all(us > 0 for us in times.values())
        assert key not in gemv.picked or times[str(gemv.picked[key])] <= times["F.linear"]
    for (w, _), (n, k) in zip((group[0] for group in groups), shapes):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        want = F.linear(x.double(), w.double())
        for config in CONFIGS:
            assert torch.allclose(launch(x, w, None, config).double(), want, atol=2e-2, rtol=2e-2), config
        assert replay_us(lambda: launch(x, w, None, CONFIGS[0]), torch.device("cuda"), 2, 2) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_folds_at_real_shapes():
    """The 8B layer's folds in bf16, compiled: the input norm into q/k/v, silu into down, the
    residual into o and down, against the torch ops within bf16 rounding."""
    from ddtree.engine.reference.fast.gemv import plain
    from ddtree.engine.reference.fast.model import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(1)
    norm = RMSNorm(4096, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data = torch.rand(4096, device="cuda", generator=g).to(torch.bfloat16) + 0.5
    cases = [((6144, 4096), norm, None), ((4096, 4096), None, True), ((4096, 12288), "silu", True)]
    for (n, k), pre, res in cases:
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        x = torch.randn(1, 2 * k if pre == "silu" else k, device="cuda", generator=g).to(torch.bfloat16)
        residual = torch.randn(1, n, device="cuda", generator=g).to(torch.bfloat16) if res else None
        want = plain(x, w, None, pre, residual).double()
        for config in CONFIGS:
            gemv = Gemv()
            gemv.picked[(n, k)] = config
            got = gemv(x, w, None, pre, residual).double()
            assert ((got - want).norm() / want.norm()).item() < 1e-2, ((n, k), config)
        gemv = Gemv()
        gemv.tune([[(w, None)] * 2], folds=[(pre, bool(res))])  # the tune times the folds on both sides
        assert set(gemv.measured[(n, k)]) == {"torch ops"} | {str(c) for c in CONFIGS}


def test_the_tune_is_told_what_each_layer_folds(monkeypatch):
    """DenseDecoder.tune_gemv hands every product's group its folds: the input norm to q/k/v, the
    residual to o, the post-attention norm to gate/up, silu and the residual to down, nothing to
    the head, so the tune times what a step runs."""
    target = make_target(3)
    model = Engine(target, make_drafter(target, block_size=4, seed=1), backend="fast", max_budget=4,
                   graphs=False).target.model
    seen = {}
    monkeypatch.setattr(model.gemv, "tune", lambda groups, folds=None: seen.update(groups=groups, folds=folds))
    model.tune_gemv()
    first = model.model.layers[0]
    shapes = [tuple(g[0][0].shape) for g in seen["groups"]]
    assert shapes == [tuple(first.self_attn.qkv[0].shape), tuple(first.self_attn.o_proj.weight.shape),
                      tuple(first.mlp.gate_up[0].shape), tuple(first.mlp.down_proj.weight.shape),
                      tuple(model.lm_head.weight.shape)]
    assert seen["folds"] == [(first.input_layernorm, False), (None, True), (first.post_attention_layernorm, False),
                             ("silu", True), None]
    assert all(len(g) == len(model.model.layers) for g in seen["groups"][:4])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_tune_and_every_tiling(dtype):
    """The demo target's shapes at a verify's row counts: the tune measures every tiling over all
    of a shape's weights, keeps the kernel only where it won, and every tiling computes the
    product (float32: exactly as float32 should, not TF32's 10-bit inputs)."""
    from ddtree.engine.reference.fast.gemv import plain
    from ddtree.engine.reference.fast.model import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(3)
    norm = RMSNorm(256, 1e-6).to("cuda", dtype)
    shapes = [((768, 256), (norm, False)), ((256, 256), (None, True)), ((256, 768), ("silu", True)), ((4096, 256), None)]
    groups = [[((torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype), None) for _ in range(4)]
              for (n, k), _ in shapes]
    gemv = Gemv()
    gemv.rows = False  # cuBLAS alone: the tune measures nothing
    gemv.tune_rows(groups, [2], folds=[f for _, f in shapes])
    assert gemv.measured_rows == {}
    gemv.rows = True
    gemv.tune_rows(groups, [1, 2, 17, 65, 300], folds=[f for _, f in shapes])
    assert {m for m, _, _ in gemv.measured_rows} == {2, 17, 65}
    for key, times in gemv.measured_rows.items():
        base = next(v for name, v in times.items() if not name.startswith("RowsConfig"))
        tried = rows_configs(key[0], fma=dtype == torch.float32)
        assert len(times) == 1 + len(tried) and all(us > 0 for us in times.values())
        assert key not in gemv.picked_rows or times[str(gemv.picked_rows[key])] <= base
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for group, ((n, k), fold) in zip(groups, shapes):
        w = group[0][0]
        pre, res = fold if fold is not None else (None, False)
        for m in (2, 17, 65):
            x = torch.randn(m, 2 * k if pre == "silu" else k, device="cuda", generator=g).to(dtype)
            residual = torch.randn(m, n, device="cuda", generator=g).to(dtype) if res else None
            want = plain(x.double(), w.double(), None, pre.double() if pre is norm else pre,
                         None if residual is None else residual.double())
            for config in rows_configs(m, fma=True):
                probe = Gemv()
                probe.picked_rows[(m, n, k)] = config
                got = probe(x, w, None, pre, residual).double()
                assert ((got - want).norm() / want.norm()).item() < tol, ((m, n, k), config)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_with_the_few_row_kernel_tuned_in_equal_ar():
    """The engine with the few-row kernel's tunes on (the target's verify buckets, the drafter's
    block, head and appends), graphs captured, in float32: DFlash and DDTree output equal AR's
    token for token, and the transformers path's."""
    from .test_cuda_fast import _compare, _tiny_prompts

    model = make_target(43).to("cuda")
    drafter = make_drafter(model, block_size=8, seed=6)
    ref = Engine(model, drafter, backend="transformers", max_budget=64)
    fast = Engine(model, drafter, backend="fast", max_budget=64)
    assert fast.target.model.gemv.rows and fast.impl.drafts.linear.kernels  # the default
    fast.warmup(budgets=(16, 64))
    assert fast.graphs and fast.target.model.gemv.measured_rows
    specs = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 16), SpecParams("ddtree", 64)]
    assert _compare(ref, fast, _tiny_prompts(), GenParams(max_new_tokens=24, ignore_eos=True), specs) > 0


def test_many_row_counts_share_one_compiled_graph_while_no_few_row_shape_is_picked():
    """The compiled decoder layer serves every query bucket past one row with one graph: `takes`
    must not read the row count as an int (a guard per count) unless the few-row kernel was
    picked for some shape."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    gemv = Gemv()
    gemv.picked[(32, 64)] = Config(8, 32, 4, 2)  # a one-row pick, as on a GPU
    w = torch.randn(32, 64)
    counter = CompileCounter()
    fn = torch.compile(lambda x: gemv(x, w), backend=counter, dynamic=None)
    for m in (2, 3, 5, 9, 17, 33):
        fn(torch.randn(m, 64))
    assert counter.frame_count <= 2  # the first count, then one dynamic graph for the rest
    torch._dynamo.reset()
