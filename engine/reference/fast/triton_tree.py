"""The Triton kernel of the draft-tree build (fast/tree_build.py launches it and says what it
computes). Under TRITON_INTERPRET=1, set before triton is first imported, Triton's interpreter runs
it on CPU tensors, so the tests check this very code on a machine without a GPU.

This module imports triton; nothing imports it unless triton is installed.
"""

import triton
import triton.language as tl

@triton.jit
def _key(score, idx):
    """An int64 that orders (score descending, idx ascending) when sorted descending: the score's
    bits made order-preserving in the high word, 2^31-1-idx in the low word. Keys of distinct
    indices differ, so a sort of keys is deterministic. +0.0 makes -0.0 equal to 0.0, as a float
    comparison has it."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 2147483647)
    return (ordered.to(tl.int64) << 32) + (2147483647 - idx).to(tl.int64)


@triton.jit
def _unkey(key):
    high = key >> 32
    ordered = high.to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 2147483647)
    return bits.to(tl.float32, bitcast=True), (2147483647 - (key - (high << 32))).to(tl.int32)


@triton.jit
def _nothing(like):
    """A key below every real one (the high word of a NaN that no score maps to)."""
    return (tl.full(like.shape, -2147483648, tl.int32).to(tl.int64)) << 32


@triton.jit
def build_tree(TV, TI, ROOTS, STEPS, ROWS, COLS, DEPTHS, SC, PAR, TOK, SLOT,
               OUT_TOK, OUT_DEP, OUT_PAR, OUT_SC, VIS,
               depth_count, k, total, n, walk_steps,
               s_tv_b, s_tv_d, s_ti_b, s_ti_d, s_w_b, s_o_b, s_v_b, s_v_i,
               PK: tl.constexpr, PC: tl.constexpr, PT: tl.constexpr, PN: tl.constexpr):
    """One batch row's tree. TV/TI [b, L, k]: each depth's top-k log-probs (best first) and their
    tokens. STEPS [L, 3] int32 per depth: the candidate pairs to score (pairs of parent rank,
    token rank: ROWS, COLS), the beam width kept, the layout index of the beam's first node.
    Layout index 0 is the root, then each depth's beam in turn (DEPTHS: each index's depth).
    The scratch rows SC, PAR, TOK, SLOT [b, >= total] hold each layout index's score, parent,
    token, and output slot."""
    b = tl.program_id(0)
    tv = TV + b * s_tv_b
    ti = TI + b * s_ti_b
    sc = SC + b * s_w_b
    par = PAR + b * s_w_b
    tok = TOK + b * s_w_b
    slot_of = SLOT + b * s_w_b

    # The root (score 0, its own parent), then depth 1: the top k tokens themselves.
    kk = tl.arange(0, PK)
    k_ok = kk < k
    zero = kk * 0
    first = kk == 0
    tl.store(sc + zero, zero.to(tl.float32), mask=first)
    tl.store(par + zero, zero, mask=first)
    tl.store(tok + zero, tl.load(ROOTS + b + zero, mask=first, other=0), mask=first)
    # Clamped to <= 0: a child never outscores its parent, so ties at the cut keep parents.
    tl.store(sc + 1 + kk, tl.minimum(tl.load(tv + kk, mask=k_ok, other=0.0).to(tl.float32), 0.0), mask=k_ok)
    tl.store(par + 1 + kk, zero, mask=k_ok)
    tl.store(tok + 1 + kk, tl.load(ti + kk, mask=k_ok, other=0), mask=k_ok)
    tl.debug_barrier()

    # Each further depth: score the candidate pairs (a kept prefix of the depth above, sorted
    # best first, extended by one of this depth's top tokens) and keep the best, sorted.
    c = tl.arange(0, PC)
    for d in range(1, depth_count):
        used = tl.load(STEPS + 3 * d)
        width = tl.load(STEPS + 3 * d + 1)
        start = tl.load(STEPS + 3 * d + 2)
        above = tl.load(STEPS + 3 * (d - 1) + 2)
        ok = c < used
        row = tl.load(ROWS + c, mask=ok, other=0)
        col = tl.load(COLS + c, mask=ok, other=0)
        child = tl.minimum(tl.load(tv + d * s_tv_d + col, mask=ok, other=0.0).to(tl.float32), 0.0)
        score = tl.load(sc + above + row, mask=ok, other=0.0) + child
        key = tl.where(ok, _key(score, c), _nothing(c))
        best, pick = _unkey(tl.sort(key, descending=True))
        take = c < width
        pick = tl.where(take, pick, 0)
        tl.store(sc + start + c, best, mask=take)
        tl.store(par + start + c, above + tl.load(ROWS + pick, mask=take, other=0), mask=take)
        tl.store(tok + start + c, tl.load(ti + d * s_ti_d + tl.load(COLS + pick, mask=take, other=0),
                                         mask=take, other=0), mask=take)
        tl.debug_barrier()

    # The n best over all depths: above the n-th best key, which puts a tie's earlier layout
    # index (a parent before an equal child) first. Kept nodes go out in layout order.
    t = tl.arange(0, PT)
    t_ok = t < total
    score = tl.load(sc + t, mask=t_ok, other=0.0)
    key = tl.where(t_ok, _key(score, t), _nothing(t))
    cut = tl.sum(tl.where(t == n - 1, tl.sort(key, descending=True), 0), 0)
    keep = t_ok & (key >= cut)
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(slot_of + t, slot, mask=keep)
    out = b * s_o_b + slot
    tl.store(OUT_TOK + out, tl.load(tok + t, mask=keep, other=0), mask=keep)
    tl.store(OUT_DEP + out, tl.load(DEPTHS + t, mask=keep, other=0), mask=keep)
    tl.store(OUT_SC + out, score, mask=keep)
    parent = tl.load(par + t, mask=keep, other=0)
    tl.debug_barrier()
    tl.store(OUT_PAR + out, tl.load(slot_of + parent, mask=keep, other=0).to(tl.int64), mask=keep)
    tl.debug_barrier()

    # The ancestor matrix: each node marks itself and every node up its parent chain (the root
    # is its own parent, so walking past it stays there). VIS arrives zeroed.
    i = tl.arange(0, PN)
    i_ok = i < n
    vis = VIS + b * s_v_b + i * s_v_i
    node = i
    for _ in range(0, walk_steps + 1):
        tl.store(vis + node, tl.full([PN], 1, tl.int8), mask=i_ok)
        node = tl.load(OUT_PAR + b * s_o_b + node, mask=i_ok, other=0).to(tl.int32)
