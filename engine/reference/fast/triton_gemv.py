"""The Triton kernel of fast/gemv.py (which launches it and says why it exists). Under
TRITON_INTERPRET=1, set before triton is first imported, Triton's interpreter runs it on CPU
tensors, for the tests on a machine without a GPU.

This module imports triton; nothing imports it unless triton is installed.
"""

import triton
import triton.language as tl


@triton.jit
def gemv(X, W, BIAS, Y, RES, NORM, N, K, sw, eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PRE: tl.constexpr, HAS_RES: tl.constexpr):
    """y[n] = sum_k W[n, k] x[k] (+ bias[n]) (+ RES[n]) for BLOCK_N outputs a program: W's rows
    are read once, contiguous along k, the products summed in float32 and y rounded once. EVEN:
    BLOCK_N divides N and BLOCK_K divides K (no masks). x is X, or what the op before the product
    would have made of it, in float32 and rounded to X's dtype as that op's output was:
    PRE 1: silu(X[k]) * X[K + k] (X holds the fused [gate; up]); PRE 2: RMSNorm, X[k] * rstd *
    NORM[k] with rstd = 1 / sqrt(mean(X^2) + eps), which every program computes for itself (X is
    one row, read from L2)."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    row = n.to(tl.int64) * sw  # 64-bit: a large head (vocabulary x hidden) passes 2**31 elements
    if PRE == 2:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            squares += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(X + k)
            w = tl.load(W + row[:, None] + k[None, :])
        else:
            x = tl.load(X + k, mask=k < K, other=0.0)
            w = tl.load(W + row[:, None] + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        if PRE == 1:
            gate = x.to(tl.float32)
            up = tl.load(X + K + k, mask=k < K, other=0.0).to(tl.float32)
            x = (gate / (1.0 + tl.exp(-gate)) * up).to(X.dtype.element_ty)
        elif PRE == 2:
            x = (x.to(tl.float32) * rstd * tl.load(NORM + k, mask=k < K, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(RES + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_ok)


@triton.jit
def _rstd(X, xrow, m_ok, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each of BLOCK_M rows (an RMSNorm folded in, PRE 2)."""
    squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(X + xrow[:, None] + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        squares += v * v
    return 1.0 / tl.sqrt(tl.sum(squares, 1) / K + eps)


@triton.jit
def _tile(X, M, N, K, sx, sw, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PRE: tl.constexpr):
    """This program's rows and outputs, their masks, X's and W's row offsets, and each row's
    rstd where an RMSNorm is folded in (PRE 2; zeros otherwise)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    xrow = m.to(tl.int64) * sx
    if PRE == 2:
        rstd = _rstd(X, xrow, m_ok, K, eps, BLOCK_M, BLOCK_K)
    else:
        rstd = tl.zeros([BLOCK_M], tl.float32)
    return m, n, m_ok, n < N, xrow, n.to(tl.int64) * sw, rstd


@triton.jit
def _inputs(X, NORM, xrow, m_ok, k, K, rstd, PRE: tl.constexpr):
    """The [rows, k] tile of the product's input: X's, or what PRE's op would have made of it
    (as gemv's, per row), rounded to X's dtype as that op's output was."""
    k_ok = k < K
    x = tl.load(X + xrow[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if PRE == 1:
        gate = x.to(tl.float32)
        up = tl.load(X + xrow[:, None] + K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(X.dtype.element_ty)
    elif PRE == 2:
        x = (x.to(tl.float32) * rstd[:, None]
             * tl.load(NORM + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(X.dtype.element_ty)
    return x


@triton.jit
def _finish(acc, BIAS, Y, RES, m, n, m_ok, n_ok, N, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """Y[m, n] = acc (+ bias[n]) (+ RES[m, n]), rounded once to Y's dtype."""
    out = m.to(tl.int64)[:, None] * N + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc += tl.load(RES + out, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def rows(X, W, BIAS, Y, RES, NORM, M, N, K, sx, sw, eps, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr, HAS_RES: tl.constexpr,
         IEEE: tl.constexpr):
    """Y[m, n] = sum_k W[n, k] x[m, k] (+ bias[n]) (+ RES[m, n]) for a BLOCK_M x BLOCK_N tile a
    program: gemv's product for a few rows, each W tile read once for all of them and multiplied
    with tl.dot (IEEE: in exact float32, as cuBLAS without TF32 does). X's rows are sx apart; Y
    and RES are contiguous [M, N]. PRE as gemv's, RMSNorm per row (rstd from the whole row)."""
    m, n, m_ok, n_ok, xrow, wrow, rstd = _tile(X, M, N, K, sx, sw, eps, BLOCK_M, BLOCK_N, BLOCK_K, PRE)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _inputs(X, NORM, xrow, m_ok, k, K, rstd, PRE)
        w = tl.load(W + wrow[:, None] + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    _finish(acc, BIAS, Y, RES, m, n, m_ok, n_ok, N, HAS_BIAS, HAS_RES)


@triton.jit
def rows_fma(X, W, BIAS, Y, RES, NORM, M, N, K, sx, sw, eps, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr, HAS_RES: tl.constexpr):
    """rows' product without tl.dot, for float32: each program multiplies a [BLOCK_N, BLOCK_K] W
    tile into its BLOCK_M rows elementwise, keeping BLOCK_M x BLOCK_N x BLOCK_K float32 partial
    sums, and sums along K once at the end, as gemv does for one row. The tiles are small, so
    even a product of 256 outputs runs on about a hundred programs, where tl.dot's 16-row tiles
    of exact float32 (and cuBLAS) left most of the GPU idle over a long K: 21-23 us for the demo
    target's 256 x 768 down product at 17 rows on an H100, against about 2 for one row on gemv."""
    m, n, m_ok, n_ok, xrow, wrow, rstd = _tile(X, M, N, K, sx, sw, eps, BLOCK_M, BLOCK_N, BLOCK_K, PRE)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _inputs(X, NORM, xrow, m_ok, k, K, rstd, PRE).to(tl.float32)
        w = tl.load(W + wrow[:, None] + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    _finish(tl.sum(acc, 2), BIAS, Y, RES, m, n, m_ok, n_ok, N, HAS_BIAS, HAS_RES)
