"""The Triton kernels of fast/row_ops.py (which launches them and says why they exist). Under
TRITON_INTERPRET=1, set before triton is first imported, Triton's interpreter runs them on CPU
tensors, for the tests on a machine without a GPU.

This module imports triton; nothing imports it unless triton is installed.
"""

import triton
import triton.language as tl


@triton.jit
def silu_mul(X, OUT, inner, s_x, s_o, BLOCK: tl.constexpr):
    """OUT[t, c] = silu(X[t, c]) * X[t, inner + c] for BLOCK columns of row t a program (X holds
    the fused [gate; up]). As the two torch ops round: silu's output to X's dtype, then the
    product, both computed in float32."""
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inner
    gate = tl.load(X + t * s_x + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + t * s_x + inner + c, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(OUT + t * s_o + c, (act * up).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def rms_norm(X, W, OUT, width, eps, s_x, s_o, BLOCK: tl.constexpr):
    """OUT[t] = X[t] * rstd * W, rstd = 1 / sqrt(mean(X[t]^2) + eps), one row a program, in
    float32 rounded once (model.RMSNorm's CUDA arithmetic, F.rms_norm with the weight)."""
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < width
    x = tl.load(X + t * s_x + c, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / width + eps)
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + t * s_o + c, (x * rstd * w).to(OUT.dtype.element_ty), mask=ok)
