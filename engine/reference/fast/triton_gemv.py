"""The Triton kernel of fast/gemv.py (which launches it and says why it exists). Under
TRITON_INTERPRET=1, set before triton is first imported, Triton's interpreter runs it on CPU
tensors, for the tests on a machine without a GPU.

This module imports triton; nothing imports it unless triton is installed.
"""

import triton
import triton.language as tl


@triton.jit
def gemv(X, W, BIAS, Y, N, K, sw, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         EVEN: tl.constexpr):
    """y[n] = sum_k W[n, k] x[k] (+ bias[n]) for BLOCK_N outputs a program: W's rows are read
    once, contiguous along k, and the products summed in float32. EVEN: BLOCK_N divides N and
    BLOCK_K divides K (no masks)."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    row = n.to(tl.int64) * sw  # 64-bit: a large head (vocabulary x hidden) passes 2**31 elements
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(X + k)
            w = tl.load(W + row[:, None] + k[None, :])
        else:
            x = tl.load(X + k, mask=k < K, other=0.0)
            w = tl.load(W + row[:, None] + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_ok)
