"""The Triton kernels of tree attention (fast/tree_attention.py launches them and says what they
compute). Under TRITON_INTERPRET=1, set before triton is first imported, Triton's interpreter runs
them on CPU tensors: the tests check this very code on a machine without a GPU.

This module imports triton; nothing imports it unless triton is installed.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_block(q, k_base, v_base, kb, length, total, i, r_ok, tree_base, st_i, sk_r, sv_r, dd,
                  m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  HAS_TREE: tl.constexpr, IEEE: tl.constexpr):
    """One key block into the running (max, sum, output) of an online softmax in base 2. Blocks
    wholly inside the context need no mask (MASKED False); the last ones hold the context's end,
    the new rows (under the tree) and rows past them."""
    c = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASKED:
        c_ok = c < total
        k = tl.load(k_base + c[:, None] * sk_r + dd[None, :], mask=c_ok[:, None], other=0.0)
        v = tl.load(v_base + c[:, None] * sv_r + dd[None, :], mask=c_ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + c[:, None] * sk_r + dd[None, :])
        v = tl.load(v_base + c[:, None] * sv_r + dd[None, :])
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASKED:
        if HAS_TREE:
            j = c - length
            new = (j >= 0) & c_ok
            t = tl.load(tree_base + i[:, None] * st_i + j[None, :], mask=r_ok[:, None] & new[None, :], other=0)
            seen = (c < length)[None, :] | (t != 0)
        else:
            seen = c_ok[None, :] & (i >= 0)[:, None]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps max -inf; exp2(-inf - 0) is 0, never NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if IEEE:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p, v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _per_split(blocks, splits, fitted, min_blocks):
    """Key blocks a split takes at a length of `blocks` key blocks. The splits used are `fitted`
    (the count the tiling was fitted with, tree_attention._PLAN_ROWS) until the length needs more
    at min_blocks a split, and never more than the launch's `splits`: a large cache splits a short
    context as the fitted one does, since a merge of many splits costs more than it saves."""
    used = tl.minimum(splits, tl.maximum(fitted, tl.cdiv(blocks, min_blocks)))
    return tl.cdiv(blocks, used)


@triton.jit
def attend_split(Q, K, V, LENGTHS, TREE, SLOTS, OUT, PART, ML,
                 n, rows_per_kv, kv_heads, groups, splits, fitted, min_blocks, scale, ml_half,
                 sq_n, sq_h, sk_b, sk_h, sk_r, sv_b, sv_h, sv_r, st_b, st_i, so_n, so_h,
                 sp_s, sp_p, sp_r, sm_s, sm_p,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_TREE: tl.constexpr, HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr, FINAL: tl.constexpr):
    """One (batch row, kv head) x query block x key split. HAS_SLOTS: batch row b reads cache
    slot SLOTS[b] (a device value) rather than slot b. Query row r of a kv head is query
    i = r % n of head kv*groups + r // n (the fold of model.py); the split streams its share of
    key blocks [0, cdiv(length + n, BLOCK_N)) (_per_split) with an online softmax; splits past
    the length's share do nothing. FINAL (one split): writes the
    normalised output; else the unnormalised sum, its running max (base 2) and its sum of weights.
    IEEE: both products in exact float32 (float32 inputs; and half inputs under the interpreter,
    whose dot of half types is wrong, after the same rounding of the probabilities)."""
    pair = tl.program_id(0)
    block = tl.program_id(1)
    split = tl.program_id(2)
    b = pair // kv_heads
    h = pair % kv_heads
    length = tl.load(LENGTHS + b).to(tl.int32)
    total = length + n
    blocks = tl.cdiv(total, BLOCK_N)
    per = _per_split(blocks, splits, fitted, min_blocks)
    lo = split * per
    hi = tl.minimum(lo + per, blocks)
    clean = tl.minimum(tl.maximum(length // BLOCK_N, lo), hi)  # [lo, clean) need no mask

    r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < rows_per_kv
    i = r % n
    head = h * groups + r // n
    dd = tl.arange(0, D)
    q = tl.load(Q + (b * n + i)[:, None] * sq_n + head[:, None] * sq_h + dd[None, :],
                mask=r_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    slot = b
    if HAS_SLOTS:
        slot = tl.load(SLOTS + b)
    k_base = K + slot * sk_b + h * sk_h
    v_base = V + slot * sv_b + h * sv_h
    tree_base = TREE + b * st_b
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2
    for kb in range(lo, clean):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, kb, length, total, i, r_ok, tree_base, st_i, sk_r,
                                      sv_r, dd, m_i, l_i, acc, qk_scale, BLOCK_N, False, HAS_TREE, IEEE)
    for kb in range(clean, hi):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, kb, length, total, i, r_ok, tree_base, st_i, sk_r,
                                      sv_r, dd, m_i, l_i, acc, qk_scale, BLOCK_N, True, HAS_TREE, IEEE)
    if FINAL:
        out = acc / l_i[:, None]
        tl.store(OUT + (b * n + i)[:, None] * so_n + head[:, None] * so_h + dd[None, :],
                 out.to(OUT.dtype.element_ty), mask=r_ok[:, None])
    else:
        tl.store(PART + split * sp_s + pair * sp_p + r[:, None] * sp_r + dd[None, :], acc,
                 mask=r_ok[:, None])
        tl.store(ML + split * sm_s + pair * sm_p + r, m_i, mask=r_ok)
        tl.store(ML + ml_half + split * sm_s + pair * sm_p + r, l_i, mask=r_ok)


@triton.jit
def merge_splits(PART, ML, OUT, LENGTHS, n, rows_per_kv, kv_heads, groups, splits, fitted, min_blocks, ml_half,
                 so_n, so_h, sp_s, sp_p, sp_r, sm_s, sm_p,
                 D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_R query rows of one (batch row, kv head): the splits' partial sums weighted by
    2^(their max - the overall max), over the weighted sum of weights. Only the splits that had
    key blocks at this row's length are read (attend_split's division). Every row sees at least
    itself, so some split has a finite max."""
    pair = tl.program_id(0)
    block = tl.program_id(1)
    b = pair // kv_heads
    h = pair % kv_heads
    blocks = tl.cdiv(tl.load(LENGTHS + b).to(tl.int32) + n, BLOCK_N)
    active = tl.cdiv(blocks, _per_split(blocks, splits, fitted, min_blocks))
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows_per_kv
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, active):
        top = tl.maximum(top, tl.load(ML + s * sm_s + pair * sm_p + r, mask=r_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)  # rows past the end: no -inf - -inf
    dd = tl.arange(0, D)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, active):
        w = tl.exp2(tl.load(ML + s * sm_s + pair * sm_p + r, mask=r_ok, other=float("-inf")) - top)
        total += w * tl.load(ML + ml_half + s * sm_s + pair * sm_p + r, mask=r_ok, other=0.0)
        part = tl.load(PART + s * sp_s + pair * sp_p + r[:, None] * sp_r + dd[None, :],
                       mask=r_ok[:, None], other=0.0)
        acc += part * w[:, None]
    out = acc / tl.where(r_ok, total, 1.0)[:, None]
    i = r % n
    head = h * groups + r // n
    tl.store(OUT + (b * n + i)[:, None] * so_n + head[:, None] * so_h + dd[None, :],
             out.to(OUT.dtype.element_ty), mask=r_ok[:, None])
