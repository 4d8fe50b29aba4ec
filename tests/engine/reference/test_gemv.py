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
from ddtree.engine.reference.fast.gemv import CONFIGS, Config, Gemv, launch

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
    assert gemv.measured == {} and gemv.picked == {}


@pytest.mark.slow
def test_static_path_with_one_row_products_on_the_kernel_decodes_the_same(monkeypatch):
    """Greedy AR output, token for token: the static path with every one-row product of the target
    (q/k/v, o, gate/up, down, the head) on the kernel, against the eager path without it."""
    model = make_target(31).to(DEVICE)
    drafter = make_drafter(model, block_size=6, seed=4).to(DEVICE)
    eager = Engine(model, drafter, backend="fast", max_budget=16, graphs=False)
    fast = Engine(model, drafter, backend="fast", max_budget=16, attention="triton", graphs=False)
    fast.target.static = True
    decoder = fast.target.model
    layer = decoder.model.layers[0]
    shapes = {tuple(w.shape) for w in (layer.self_attn.qkv[0], layer.self_attn.o_proj.weight,
                                       layer.mlp.gate_up[0], layer.mlp.down_proj.weight, decoder.lm_head.weight)}
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
