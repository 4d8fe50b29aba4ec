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
def _keep_best(key, width, start, above, sc, par, tok, ti_d, ROWS, COLS, W: tl.constexpr):
    """Sort W candidate keys and store the best `width` as the beam at layout [start, start+width):
    score, parent (the layout index `above` + the pair's parent rank) and token."""
    best, pick = _unkey(tl.sort(key, descending=True))
    j = tl.arange(0, W)
    take = j < width
    pick = tl.where(take, pick, 0)
    tl.store(sc + start + j, best, mask=take)
    tl.store(par + start + j, above + tl.load(ROWS + pick, mask=take, other=0).to(tl.int32), mask=take)
    tl.store(tok + start + j, tl.load(ti_d + tl.load(COLS + pick, mask=take, other=0), mask=take, other=0),
             mask=take)


@triton.jit
def _compacted(key, ok, count, KEYS, NARROW: tl.constexpr):
    """The keys where ok (count of them, at most NARROW) moved to the front of a NARROW-wide
    tensor through the scratch KEYS; the rest of it below every real key."""
    tl.store(KEYS + tl.cumsum(ok.to(tl.int32), 0) - 1, key, mask=ok)
    tl.debug_barrier()
    s = tl.arange(0, NARROW)
    return tl.where(s < count, tl.load(KEYS + s, mask=s < count, other=0), _nothing(s))


@triton.jit
def _nth_key(key, ok, count, nth, KEYS, WIDE: tl.constexpr, NARROW: tl.constexpr):
    """The nth best (0-based) of the keys where ok; count of them. At most NARROW of them sort
    compacted; more take the WIDE sort."""
    if count <= NARROW:
        s = tl.arange(0, NARROW)
        cut = tl.sum(tl.where(s == nth, tl.sort(_compacted(key, ok, count, KEYS, NARROW), descending=True), 0), 0)
    else:
        w = tl.arange(0, WIDE)
        cut = tl.sum(tl.where(w == nth, tl.sort(key, descending=True), 0), 0)
    return cut


@triton.jit
def build_tree(TV, TI, ROOTS, STEPS, ROWS, COLS, DEPTHS, SC, PAR, TOK, SLOT, KEYS,
               OUT_TOK, OUT_DEP, OUT_PAR, OUT_SC, VIS,
               depth_count, k, budget, total, n, walk_steps,
               s_tv_b, s_tv_d, s_ti_b, s_ti_d, s_w_b, s_k_b, s_o_b, s_v_b, s_v_i,
               PK: tl.constexpr, PM: tl.constexpr, PC: tl.constexpr, PS: tl.constexpr,
               PT: tl.constexpr, PF: tl.constexpr, PN: tl.constexpr):
    """One batch row's tree. TV/TI [b, L, k]: each depth's top-k log-probs (best first) and their
    tokens. STEPS [L, 2] int32 per depth: the most nodes its beam keeps, the layout index of the
    beam's first node. Candidate pair c is (parent rank ROWS[c], token rank COLS[c]);
    a beam of w parents extends the first sum(min(k, budget // (i+1)) for i < w) pairs.
    Layout index 0 is the root, then each depth's beam in turn (DEPTHS: each index's depth).
    The scratch rows SC, PAR, TOK, SLOT [b, >= total] hold each layout index's score, parent
    (-1: a slot no node took), token and output slot; KEYS [b, >= max(PC, PT)] compacted keys.

    Pruning, which changes no output: with k = budget, the root and depth 1 alone make n nodes,
    so a deeper prefix scoring at most depth 1's worst never makes the tree (it loses a tie to
    the earlier layout index), and nor do its extensions (their scores are no higher). A beam
    keeps only the candidates above that floor; they are a prefix of the full beam, in the
    same order, so every kept node has the same rank and the same candidate pairs. On flat
    drafts most depths then have no candidate at all, and the sorts run narrow (PS, PF wide)."""
    b = tl.program_id(0)
    tv = TV + b * s_tv_b
    ti = TI + b * s_ti_b
    sc = SC + b * s_w_b
    par = PAR + b * s_w_b
    tok = TOK + b * s_w_b
    slot_of = SLOT + b * s_w_b
    keys = KEYS + b * s_k_b

    # The root (score 0, its own parent), then depth 1: the top k tokens themselves.
    kk = tl.arange(0, PK)
    k_ok = kk < k
    zero = kk * 0
    first = kk == 0
    tl.store(sc + zero, zero.to(tl.float32), mask=first)
    tl.store(par + zero, zero, mask=first)
    tl.store(tok + zero, tl.load(ROOTS + b + zero, mask=first, other=0), mask=first)
    # Clamped to <= 0: a child never outscores its parent, so ties at the cut keep parents.
    depth1 = tl.minimum(tl.load(tv + kk, mask=k_ok, other=0.0).to(tl.float32), 0.0)
    tl.store(sc + 1 + kk, depth1, mask=k_ok)
    tl.store(par + 1 + kk, zero, mask=k_ok)
    tl.store(tok + 1 + kk, tl.load(ti + kk, mask=k_ok, other=0), mask=k_ok)
    # The floor: depth 1's worst where k == budget; -inf (no pruning) otherwise.
    floor = tl.where(k >= budget, tl.min(tl.where(k_ok, depth1, float("inf")), 0), float("-inf"))
    tl.debug_barrier()

    # Each further depth: score the candidate pairs (a kept prefix of the depth above, sorted
    # best first, extended by one of this depth's top tokens) and keep the best, sorted.
    c = tl.arange(0, PC)
    m = tl.arange(0, PM)
    prev = k + 0
    for d in range(1, depth_count):
        most = tl.load(STEPS + 2 * d)
        start = tl.load(STEPS + 2 * d + 1)
        above = tl.load(STEPS + 2 * (d - 1) + 1)
        width = prev * 0
        if prev > 0:
            used = tl.sum(tl.where(m < prev, tl.minimum(k, budget // (m + 1)), 0), 0)
            ok = c < used
            row = tl.load(ROWS + c, mask=ok, other=0)
            col = tl.load(COLS + c, mask=ok, other=0)
            child = tl.minimum(tl.load(tv + d * s_tv_d + col, mask=ok, other=0.0).to(tl.float32), 0.0)
            score = tl.load(sc + above + row, mask=ok, other=0.0) + child
            ok = ok & ((score > floor).to(tl.int32) + (floor == float("-inf")).to(tl.int32) > 0)
            count = tl.sum(ok.to(tl.int32), 0)
            width = tl.minimum(most, count)
            key = tl.where(ok, _key(score, c), _nothing(c))
            if count <= PS:
                _keep_best(_compacted(key, ok, count, keys, PS), width, start, above, sc, par, tok,
                           ti + d * s_ti_d, ROWS, COLS, PS)
            else:
                _keep_best(key, width, start, above, sc, par, tok, ti + d * s_ti_d, ROWS, COLS, PC)
        tl.store(par + start + m, m * 0 - 1, mask=(m >= width) & (m < most))
        tl.debug_barrier()
        prev = width

    # The n best over all depths: above the n-th best key, which puts a tie's earlier layout
    # index (a parent before an equal child) first. Kept nodes go out in layout order.
    t = tl.arange(0, PT)
    t_ok = t < total
    valid = t_ok & (tl.load(par + t, mask=t_ok, other=-1) >= 0)
    score = tl.load(sc + t, mask=valid, other=0.0)
    key = tl.where(valid, _key(score, t), _nothing(t))
    cut = _nth_key(key, valid, tl.sum(valid.to(tl.int32), 0), n - 1, keys, PT, PF)
    keep = valid & (key >= cut)
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
