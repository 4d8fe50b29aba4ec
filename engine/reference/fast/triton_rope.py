"""The Triton kernel of fast/rope_write.py (which launches it and says why it exists). Under
TRITON_INTERPRET=1, set before triton is first imported, Triton's interpreter runs it on CPU
tensors, for the tests on a machine without a GPU.

This module imports triton; nothing imports it unless triton is installed.
"""

import triton
import triton.language as tl


@triton.jit
def rope_write(QKV, QW, KW, COS, SIN, KC, VC, SLOTS, ROWS, QOUT, heads, kv_heads, eps,
               s_t, s_cos, sc_s, sc_h, sc_r, sv_s, sv_h, sv_r, so_t, so_h,
               D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_SLOTS: tl.constexpr, KV_OUT: tl.constexpr):
    """One token t x one head of the fused q/k/v product [n, (heads + 2 kv_heads) * D]. Query and
    key heads: RMSNorm over the head (statistics in float32, one rounding to the model dtype
    after the weight, as model.RMSNorm on CUDA), then RoPE: x cos + rotate_half(x) sin, with SIN's
    first half already negated (model.DenseDecoder.forward), computed in float32 and rounded
    once. Queries go to QOUT [n, heads, D]; keys and values to their cache row ROWS[t] of slot
    SLOTS[t] (slot 0 without HAS_SLOTS), and with KV_OUT to QOUT too, which is then
    [n, heads + 2 kv_heads, D]. Nothing is bounds-checked: the callers size a forward to
    fit its cache (a static forward's rows end within the cache's slack, a pool round's within
    its slots), as index_copy_ would otherwise have asserted."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    dd = tl.arange(0, D)
    base = QKV + t * s_t + h * D
    row = tl.load(ROWS + t)
    if HAS_SLOTS:
        slot = tl.load(SLOTS + t)
    else:
        slot = row * 0
    if h >= heads + kv_heads:  # a value head: copied as it is
        v = tl.load(base + dd)
        tl.store(VC + slot * sv_s + (h - heads - kv_heads) * sv_h + row * sv_r + dd, v)
        if KV_OUT:
            tl.store(QOUT + t * so_t + h * so_h + dd, v)
    else:
        half = (dd + D // 2) % D  # rotate_half's source lane for each lane
        x = tl.load(base + dd).to(tl.float32)
        xr = tl.load(base + half).to(tl.float32)
        if HAS_NORM:
            scale = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            if h < heads:
                w = tl.load(QW + dd).to(tl.float32)
                wr = tl.load(QW + half).to(tl.float32)
            else:
                w = tl.load(KW + dd).to(tl.float32)
                wr = tl.load(KW + half).to(tl.float32)
            x = (x * scale * w).to(QKV.dtype.element_ty).to(tl.float32)
            xr = (xr * scale * wr).to(QKV.dtype.element_ty).to(tl.float32)
        cos = tl.load(COS + t * s_cos + dd).to(tl.float32)
        sin = tl.load(SIN + t * s_cos + dd).to(tl.float32)
        out = (x * cos + xr * sin).to(QKV.dtype.element_ty)
        if h < heads:
            tl.store(QOUT + t * so_t + h * so_h + dd, out)
        else:
            tl.store(KC + slot * sc_s + (h - heads) * sc_h + row * sc_r + dd, out)
            if KV_OUT:
                tl.store(QOUT + t * so_t + h * so_h + dd, out)
