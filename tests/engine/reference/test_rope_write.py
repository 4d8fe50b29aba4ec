"""rope_write (fast/rope_write.py): one kernel for the new rows' q/k norms, RoPE and K/V cache
writes, against a float64-free restatement of those ops and against model.Attention with the
kernel off (single cache and pool); and inside a torch.compile'd function, where its cache writes
must land in the caller's tensors. Without a GPU the kernel runs in Triton's
interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.fast.model import AttentionPlan, BatchPlan, DecoderConfig, DenseDecoder, RMSNorm
from ddtree.engine.reference.fast.rope_write import launch, rope_write

from .test_tree_attention import _runs_here

pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton: CUDA, or its interpreter 3.7.1+")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _setup(n, heads, kv_heads, d, dtype, norm, seed, pool=0):
    g = torch.Generator().manual_seed(seed)
    cfg = DecoderConfig(model_type="qwen3", vocab_size=8, hidden_size=heads * d, intermediate_size=8,
                        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d)
    decoder = DenseDecoder(cfg)
    positions = torch.randint(0, 300, (n,), generator=g)
    cos, sin = decoder.rope(positions, dtype)
    sin = torch.cat((-sin[..., :d // 2], sin[..., d // 2:]), dim=-1)  # the rolled form forward passes
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    weights = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5) if norm else (None, None)
    shape = (pool, kv_heads, 40, d) if pool else (kv_heads, 40, d)
    caches = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    rows = torch.randperm(40, generator=g)[:n]
    slots = torch.randint(0, pool, (n,), generator=g) if pool else None
    return qkv, weights, cos, sin, caches, rows, slots


def _reference(qkv, weights, cos, sin, caches, rows, slots, heads, kv_heads, eps=1e-6):
    """model.Attention's plain ops: split, norms, rolled RoPE, index writes."""
    n, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)
    if weights[0] is not None:
        qn, kn = RMSNorm(d, eps), RMSNorm(d, eps)
        qn.weight.data, kn.weight.data = weights[0].to(qkv.dtype), weights[1].to(qkv.dtype)
        q, k = qn(q.float()).to(qkv.dtype), kn(k.float()).to(qkv.dtype)
    qk = torch.cat((q, k), dim=1).float()
    qk = (qk * cos.float() + qk.roll(d // 2, dims=-1) * sin.float()).to(qkv.dtype)
    q, k = qk.split([heads, kv_heads], dim=1)
    kc, vc = (c.clone() for c in caches)
    if slots is None:
        kc[:, rows], vc[:, rows] = k.transpose(0, 1), v.transpose(0, 1)
    else:
        kc[slots, :, rows], vc[slots, :, rows] = k, v
    return q, kc, vc


@pytest.mark.parametrize("n,heads,kv_heads,d,norm,pool", [(1, 4, 2, 16, True, 0), (5, 6, 2, 32, True, 0),
                                                          (3, 4, 4, 16, False, 0), (7, 4, 2, 16, True, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_plain_ops(n, heads, kv_heads, d, norm, pool, dtype):
    qkv, weights, cos, sin, caches, rows, slots = _setup(n, heads, kv_heads, d, dtype, norm, n + d, pool)
    want_q, want_k, want_v = _reference(qkv, weights, cos, sin, caches, rows, slots, heads, kv_heads)
    on = [t.to(DEVICE) if t is not None else None for t in (qkv, *weights, cos, sin, *caches, slots, rows)]
    qkv_d, qw, kw, cos_d, sin_d, kc, vc, slots_d, rows_d = on
    w = (qw.to(dtype), kw.to(dtype)) if norm else (None, None)
    q = launch(qkv_d, w[0], w[1], cos_d, sin_d, 1e-6, kc, vc, slots_d, rows_d, heads, kv_heads)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    assert torch.allclose(q.cpu().float(), want_q.float(), **tol)
    assert torch.allclose(kc.cpu().float(), want_k.float(), **tol)
    assert torch.equal(vc.cpu(), want_v)  # values are copied bit for bit; untouched rows stay


def test_keys_and_values_come_back_with_kv_out():
    """For a packed prefill's flash attention the kernel hands back the rotated keys and the
    values beside the queries, as it writes them to the pool."""
    heads, kv_heads, d, n = 4, 2, 16, 6
    qkv, weights, cos, sin, caches, rows, slots = _setup(n, heads, kv_heads, d, torch.float32, True, 4, pool=3)
    want_q, want_k, want_v = _reference(qkv, weights, cos, sin, caches, rows, slots, heads, kv_heads)
    on = [t.to(DEVICE) for t in (qkv, *weights, cos, sin, *caches, slots, rows)]
    qkv_d, qw, kw, cos_d, sin_d, kc, vc, slots_d, rows_d = on
    out = launch(qkv_d, qw, kw, cos_d, sin_d, 1e-6, kc, vc, slots_d, rows_d, heads, kv_heads, kv_out=True)
    assert out.shape == (n, heads + 2 * kv_heads, d)
    q, k, v = (t.cpu() for t in out.split([heads, kv_heads, kv_heads], dim=1))
    assert torch.allclose(q, want_q, atol=1e-5, rtol=1e-5)
    assert torch.allclose(k, want_k[slots, :, rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(v, want_v[slots, :, rows]) and torch.equal(v, qkv.view(n, -1, d)[:, heads + kv_heads:])
    assert torch.allclose(kc.cpu(), want_k, atol=1e-5) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("kv_out", [False, True])
def test_compiled_caller_writes_the_callers_caches(kv_out):
    """Inside torch.compile the op mutates the caches it is given (the compiled layers pass the
    layer's cache views), and the queries (with kv_out the keys and values too) come back as in
    eager."""
    heads, kv_heads, d, n = 4, 2, 16, 2
    qkv, weights, cos, sin, caches, rows, _ = _setup(n, heads, kv_heads, d, torch.float32, True, 9)
    want_q, want_k, want_v = _reference(qkv, weights, cos, sin, caches, rows, None, heads, kv_heads)
    qkv_d, qw, kw, cos_d, sin_d, rows_d = (t.to(DEVICE) for t in (qkv, *weights, cos, sin, rows))
    big_k = torch.zeros((3, *caches[0].shape), device=DEVICE)
    big_v = torch.zeros((3, *caches[1].shape), device=DEVICE)
    big_k[1], big_v[1] = caches[0].to(DEVICE), caches[1].to(DEVICE)

    def layer(qkv, k_cache, v_cache):
        return rope_write(qkv * 1.0, qw, kw, cos_d, sin_d, 1e-6, k_cache, v_cache, None, rows_d,
                          heads, kv_heads, kv_out) + 0.0

    torch._dynamo.reset()
    out = torch.compile(layer, fullgraph=True)(qkv_d, big_k[1], big_v[1]).cpu()  # inductor, as the engine's layers
    torch._dynamo.reset()
    big_k, big_v = big_k.cpu(), big_v.cpu()
    q = out[:, :heads]
    assert torch.allclose(q, want_q, atol=1e-5)
    if kv_out:
        assert out.shape == (n, heads + 2 * kv_heads, d)
        assert torch.allclose(out[:, heads:heads + kv_heads], want_k[:, rows].transpose(0, 1), atol=1e-5)
        assert torch.equal(out[:, heads + kv_heads:], want_v[:, rows].transpose(0, 1))
    assert torch.allclose(big_k[1], want_k, atol=1e-5) and torch.equal(big_v[1], want_v)
    assert not big_k[0].any() and not big_k[2].any() and not big_v[0].any() and not big_v[2].any()


@pytest.mark.parametrize("qk_norm,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("pooled", [False, True, "packed"])
def test_attention_with_the_kernel_equals_attention_without(qk_norm, bias, pooled):
    """model.Attention on the static triton paths, fused_writes on against off: the same output
    and the same caches, for a Qwen3 (q/k norms) and a Qwen2-like layer (biases, no norms); and
    for prompts packed into one row (fast/prefill.py), through the loop over them here."""
    heads, kv_heads, d, n = 4, 2, 16, 3
    cfg = DecoderConfig(model_type="qwen3" if qk_norm else "qwen2", vocab_size=8, hidden_size=64,
                        intermediate_size=8, num_hidden_layers=1, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=d, qk_norm=qk_norm, qkv_bias=bias)
    torch.manual_seed(5)
    decoder = DenseDecoder(cfg)
    with torch.no_grad():
        for p in decoder.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    decoder = decoder.to(DEVICE)
    decoder.fuse()  # after the move: the fused weights are tensors of the layer, not parameters
    attn = decoder.model.layers[0].self_attn
    g = torch.Generator().manual_seed(6)
    b = 2 if pooled else 1
    x = torch.randn(b * n, 64, generator=g).to(DEVICE)
    lengths = torch.tensor([5, 9][:b], device=DEVICE)
    positions = (lengths[:, None] + torch.arange(n, device=DEVICE)).reshape(-1)
    cos, sin = decoder.rope(positions, torch.float32)
    sin = torch.cat((-sin[..., :d // 2], sin[..., d // 2:]), dim=-1)
    tree = torch.ones(b, n, n, dtype=torch.bool, device=DEVICE).tril()
    shape = (3, kv_heads, 24, d) if pooled else (kv_heads, 24, d)
    caches = torch.randn(shape, generator=g).to(DEVICE), torch.randn(shape, generator=g).to(DEVICE)
    if pooled == "packed":  # two prompts of 2 and 1 tokens, then 2 of padding, into slots 2 and 0
        n = 5
        x = torch.randn(n, 64, generator=g).to(DEVICE)
        positions = torch.tensor([0, 1, 0, 0, 1], device=DEVICE)
        cos, sin = decoder.rope(positions, torch.float32)
        sin = torch.cat((-sin[..., :d // 2], sin[..., d // 2:]), dim=-1)
        plan = BatchPlan(b=1, q=n, slots=torch.tensor([[2, 2, 0, 2, 2]], device=DEVICE),
                         rows=torch.tensor([[0, 1, 0, 22, 23]], device=DEVICE), read=0, mask=None,
                         kernel="triton", segments=torch.tensor([0, 2, 3, 5], dtype=torch.int32, device=DEVICE),
                         segment_lengths=(2, 1, 2))
    elif pooled:
        steps = torch.arange(n, device=DEVICE)
        plan = BatchPlan(b=b, q=n, slots=torch.arange(b, device=DEVICE)[:, None].expand(b, n),
                         rows=lengths[:, None] + steps, read=24, mask=None, kernel="triton",
                         lengths=lengths, tree=tree)
    else:
        plan = AttentionPlan(lengths[0] + torch.arange(n, device=DEVICE), 24, None, kernel="triton",
                             lengths=lengths, tree=tree)
    results = []
    for fused in (False, True):
        attn.fused_writes = fused
        k, v = caches[0].clone(), caches[1].clone()
        results.append((attn(x, cos, sin, k, v, plan), k, v))
    (want, want_k, want_v), (got, got_k, got_v) = results
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(got_k, want_k, atol=1e-5) and torch.equal(got_v, want_v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,pool", [(1, 0), (17, 0), (257, 0), (16, 16)])
def test_cuda_at_the_qwen3_8b_shape(n, pool):
    heads, kv_heads, d = 32, 8, 128
    qkv, weights, cos, sin, caches, rows, slots = _setup(n, heads, kv_heads, d, torch.bfloat16, True, n, pool)
    if n > 40:  # rows beyond the helper's 40-row caches
        caches = tuple(torch.randn((kv_heads, 300, d)).to(torch.bfloat16) for _ in range(2))
        rows = torch.randperm(300)[:n]
    want_q, want_k, want_v = _reference(qkv, weights, cos, sin, caches, rows, slots, heads, kv_heads)
    cuda = [t.cuda() if t is not None else None for t in (qkv, cos, sin, *caches, slots, rows)]
    qkv_d, cos_d, sin_d, kc, vc, slots_d, rows_d = cuda
    q = launch(qkv_d, weights[0].to(torch.bfloat16).cuda(), weights[1].to(torch.bfloat16).cuda(), cos_d, sin_d, 1e-6,
               kc, vc, slots_d, rows_d, heads, kv_heads)
    tol = {"atol": 0.05, "rtol": 0.02}
    assert torch.allclose(q.cpu().float(), want_q.float(), **tol)
    assert torch.allclose(kc.cpu().float(), want_k.float(), **tol) and torch.equal(vc.cpu(), want_v)
