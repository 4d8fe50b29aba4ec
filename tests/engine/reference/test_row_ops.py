"""The row kernels (fast/row_ops.py: silu(gate) * up, the RMSNorm, the residual add in the GEMM)
against the torch ops they replace, and the engine with every product of many rows through them.
Without a GPU the kernels run in Triton's interpreter (tests/conftest.py); on CUDA, Gemv sends
every product of many rows there, so test_cuda_fast.py's and test_cuda_pool.py's identity tests
run them compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast import row_ops
from ddtree.engine.reference.fast.gemv import _before, plain
from ddtree.engine.reference.fast.model import RMSNorm

from .conftest import make_drafter, make_target
from .test_tree_attention import _runs_here

pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton: CUDA, or its interpreter 3.7.1+")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner", [(3, 1500), (1, 64), (5, 2048)])  # ragged, small, a block multiple
def test_silu_mul_equals_the_torch_ops(dtype, rows, inner):
    x = _rand(rows, 2 * inner, seed=inner, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = row_ops.silu_mul(x.to(DEVICE)).cpu()
    assert got.shape == (rows, inner) and got.dtype == dtype
    # The same two roundings, each within a bf16 ulp (the interpreter may round toward zero).
    tol = 1e-6 if dtype == torch.float32 else 2 ** -6
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_silu_mul_reads_a_strided_view():
    base = _rand(4, 300, seed=2)
    x = base[:, 20:220]  # rows 300 apart, 200 columns: gate 100, up 100
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(row_ops.silu_mul(x.to(DEVICE)).cpu(), F.silu(gate) * up, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2048, 100])
def test_rms_norm_equals_the_fused_norm(dtype, width):
    x = _rand(6, width, seed=width, dtype=dtype) * 3
    weight = (1 + _rand(width, seed=1) / 4).to(dtype)
    # model.RMSNorm on CUDA: float32 statistics, one rounding after the weight.
    want = F.rms_norm(x.float(), (width,), weight.float(), 1e-6).to(dtype)
    got = row_ops.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6).cpu()
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    norm = RMSNorm(width, 1e-6)
    norm.weight.data = weight.float()
    if dtype == torch.float32:
        assert torch.allclose(got, norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pre", [None, "silu", "norm", "gelu"])
@pytest.mark.parametrize("residual,bias", [(False, False), (True, False), (True, True), (False, True)])
def test_linear_equals_plain(pre, residual, bias):
    rows, k, n = 5, 96, 40
    width = 2 * k if pre in ("silu", "gelu") else k
    x = _rand(rows, width, seed=3)
    weight = _rand(n, k, seed=4) / k ** 0.5
    b = _rand(n, seed=5) if bias else None
    res = _rand(rows, n, seed=6) if residual else None
    if pre == "norm":
        pre = RMSNorm(k, 1e-6)
        pre.weight.data = 1 + _rand(k, seed=7) / 4
    want = plain(x, weight, b, pre, res)
    moved = [None if t is None else t.to(DEVICE) for t in (x, weight, b, res)]
    if isinstance(pre, RMSNorm):
        pre = pre.to(DEVICE)
    got = row_ops.linear(moved[0], moved[1], moved[2], pre, moved[3], _before).cpu()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gemv_sends_only_half_precision_cuda_products_of_many_rows_here():
    assert not row_ops.runs(torch.zeros(4, 8, dtype=torch.bfloat16))  # a CPU tensor: the torch ops
    assert not row_ops.runs(torch.zeros(2, 4, 8, device=DEVICE, dtype=torch.bfloat16))
    assert not row_ops.runs(torch.zeros(4, 8, device=DEVICE))  # float32 keeps the torch ops
    if DEVICE == "cuda":
        assert row_ops.runs(torch.zeros(4, 8, device=DEVICE, dtype=torch.bfloat16))


def test_a_compiled_product_of_many_rows_keeps_one_graph():
    """Inside torch.compile Gemv takes the torch ops without tracing row_ops.runs: traced on CUDA,
    its triton lookup broke the compiled layer's graph at every product (H200, 12 s stalls)."""
    from ddtree.engine.reference.fast.gemv import Gemv

    torch._dynamo.reset()
    gemv = Gemv()
    norm = RMSNorm(16, 1e-6).to(DEVICE, torch.bfloat16)
    weight = _rand(24, 16, seed=1, dtype=torch.bfloat16).to(DEVICE)
    x, res = _rand(5, 16, seed=2, dtype=torch.bfloat16).to(DEVICE), _rand(5, 24, seed=3, dtype=torch.bfloat16).to(DEVICE)
    explained = torch._dynamo.explain(lambda a, r: gemv(a, weight, None, norm, r))(x, res)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


@pytest.mark.slow
def test_engine_with_row_ops_decodes_as_without(monkeypatch):
    """Greedy output, token for token, for AR, DFlash and DDTree on the static path with every
    product of many rows (prefill, verify) through row_ops, against the same path without."""
    model = make_target(33).to(DEVICE)
    drafter = make_drafter(model, block_size=5, seed=8).to(DEVICE)
    engine = Engine(model, drafter, backend="fast", max_budget=8, graphs=False)
    engine.target.static = True
    gen = GenParams(max_new_tokens=10, ignore_eos=True)
    specs = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 8)]
    prompts = ([9], list(range(4, 30)))
    want = [engine.generate(p, gen, s).output_ids for p in prompts for s in specs]
    calls = []
    real = row_ops.linear
    monkeypatch.setattr(row_ops, "runs", lambda x: x.dim() == 2)
    monkeypatch.setattr(row_ops, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    assert [engine.generate(p, gen, s).output_ids for p in prompts for s in specs] == want
    assert calls and max(calls) > 1
