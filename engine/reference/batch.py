"""One round for many sessions at once: all their drafts in one drafter forward, all their verifies
in one target forward.

Sessions keep their own caches between rounds, so they can join and leave a batch at any round and
still be stepped alone. A batched round stacks their caches right-padded to the longest one
([b, heads, Lmax, d]), feeds every row its own positions (RoPE is applied per token from these, so
padding shifts nothing) and an additive float mask that shows each row exactly what its own single
round would show: its own context, and among the new tokens only its own ancestors. Padding columns
get the dtype's most negative value, so their softmax weight is exactly 0; padded query rows see
only themselves and are never read. After the forward each session's accepted rows are gathered to
sit right after its own context, and the session gets back views of its own rows. Every committed
token is still the target's choice at its true prefix, computed from the same inputs as in the
single path: the batched round is lossless the same way, up to float rounding of a different
matrix shape (which matters only at a true tie of the top two logits).

Prefills of several new sessions also share one forward: prompts right-padded to the longest,
a plain causal mask (a real row never looks past itself, so it never sees padding), and logits only
at each prompt's last row. On a CPU, prompts of very different lengths go in separate forwards,
as trees do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.drafter import DraftCache
from ddtree.engine.reference.target import KVCache
from ddtree.engine.reference.tree import Tree

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine

# On a compute-bound device padded query rows cost as much as real ones: a CPU verify batch is
# split where padding would exceed this share of the real rows (an AR step beside a 64-node tree).
# On CUDA a forward is weight-bound, so every row rides in one batch.
CPU_PADDING_SLACK = 1.5
# Padded tokens in one batched prefill at most (prompts of 2k tokens: 8 at a time).
PREFILL_BATCH_TOKENS = 16384


def step_many(engine: Engine, sessions: list[Session]) -> list[list[int]]:
    """One round of every session (see Engine.step_many); returns each one's committed tokens.
    Engine.step_many has checked that the sessions are distinct and this engine's."""
    out: list[list[int]] = [[] for _ in sessions]
    ready: list[int] = []
    new: list[int] = []
    for i, sess in enumerate(sessions):
        if sess.done:
            continue
        (new if sess._bonus is None else ready).append(i)
    for i, tokens in zip(new, prefill_many(engine, [sessions[i] for i in new])):
        out[i] = tokens
    if len(ready) == 1:
        out[ready[0]] = sessions[ready[0]].step()
    elif ready:
        with torch.inference_mode():
            committed = _round(engine, [sessions[i] for i in ready])
        for i, tokens in zip(ready, committed):
            out[i] = tokens
    return out


def prefill_many(engine: Engine, sessions: list[Session]) -> list[list[int]]:
    """The prefill of each new session, as `Session.step()` would do it, batched where it pays.
    A prefill in chunks steps alone: its cache already holds its earlier chunks."""
    if len(sessions) < 2:
        return [s.step() for s in sessions]
    lengths = [len(s.prompt_ids) for s in sessions]
    out: list[list[int]] = [[] for _ in sessions]
    whole = []
    for j, s in enumerate(sessions):
        if s.chunked_prefill:
            out[j] = s.step()
        else:
            whole.append(j)
    groups = []
    for group in _groups([lengths[j] for j in whole], engine.target.device.type == "cuda"):
        group = [whole[k] for k in group]
        # Bound the padded batch: long prompts together would multiply activation memory.
        width = max(lengths[j] for j in group)
        per = max(1, PREFILL_BATCH_TOKENS // width)
        groups += [group[i:i + per] for i in range(0, len(group), per)]
    for group in groups:
        members = [sessions[j] for j in group]
        if len(members) == 1:
            out[group[0]] = members[0].step()
            continue
        with torch.inference_mode():
            for j, tokens in zip(group, _prefill_group(engine, members)):
                out[j] = tokens
    return out


def _prefill_group(engine: Engine, sessions: list[Session]) -> list[list[int]]:
    t0 = engine.clock()
    target = engine.target
    device, dtype = target.device, target.dtype
    lengths = [len(s.prompt_ids) for s in sessions]
    b, width = len(sessions), max(lengths)
    ids = torch.zeros((b, width), dtype=torch.long, device=device)
    for j, s in enumerate(sessions):
        ids[j, :lengths[j]] = torch.tensor(s.prompt_ids, dtype=torch.long, device=device)
    positions = torch.arange(width, device=device).expand(b, width)
    mask = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    mask = mask.expand(b, 1, width, width)
    last = sorted(set(n - 1 for n in lengths))
    cache = target.new_cache()
    out = target.forward_batch(ids, positions, cache, mask, features=any(s.mode != "ar" for s in sessions),
                               keep=torch.tensor(last, device=device))
    # Nothing in a session changes before this point: a forward that raises leaves them all new.
    tensors = cache.tensors()
    committed = []
    for j, s in enumerate(sessions):
        n = lengths[j]
        logits = out.logits[j, last.index(n - 1) if target.has_logits_to_keep else n - 1]
        s._cache = KVCache.of(target.model, [(k[j:j + 1, :, :n], v[j:j + 1, :, :n]) for k, v in tensors])
        committed.append(s._prefilled(logits[None].float(), out.features[j, :n] if s.mode != "ar" else None))
    share = (engine.clock() - t0) / b
    for s in sessions:
        s.timings["prefill"] += share
    return committed


def _round(engine: Engine, sessions: list[Session]) -> list[list[int]]:
    """Draft, build, verify, then commit. Nothing in a session changes before the commit loop,
    so a failing forward leaves every session as it was (the scheduler then steps them alone)."""
    t0 = engine.clock()
    depths = [s._depth_cap() for s in sessions]
    drafting = [j for j, s in enumerate(sessions) if s.mode != "ar" and depths[j] > 0]
    draft_logits: list[torch.Tensor | None] = [None] * len(sessions)
    draft_state = None
    if drafting:
        logits, draft_state = _draft(engine, [sessions[j] for j in drafting], [depths[j] for j in drafting])
        for j, lg in zip(drafting, logits):
            draft_logits[j] = lg
    t1 = engine.clock()
    trees = [s._tree(lg) for s, lg in zip(sessions, draft_logits)]
    t2 = engine.clock()
    groups = _groups([t.size for t in trees], engine.target.device.type == "cuda")
    verified = []
    for group in groups:
        verified.append((group, _verify(engine, [sessions[j] for j in group], [trees[j] for j in group])))
    t3 = engine.clock()
    if draft_state is not None:
        _commit_draft_caches([sessions[j] for j in drafting], *draft_state)
    committed: list[list[int]] = [[] for _ in sessions]
    for group, (logits, features, tensors, lmax) in verified:
        walks = [sessions[j]._walk(trees[j], logits[r, :trees[j].size].float()) for r, j in enumerate(group)]
        starts = [sessions[j]._start for j in group]
        _gather_rows(tensors, [(r, starts[r], lmax, w[1]) for r, w in enumerate(walks)])
        for r, j in enumerate(group):
            sess = sessions[j]
            path, path_list, new = walks[r]
            end = starts[r] + len(path_list)
            sess._cache.assign([(k[r:r + 1, :, :end], v[r:r + 1, :, :end]) for k, v in tensors])
            feats = features[r].index_select(0, path) if features is not None and sess.mode != "ar" else None
            committed[j] = sess._advance(path_list, new, feats, drafted=draft_logits[j] is not None)
    t4 = engine.clock()
    n = len(sessions)
    for j, sess in enumerate(sessions):
        # Batch time is shared: each session books its share, so sums over sessions stay true.
        if draft_logits[j] is not None:
            sess.timings["draft"] += (t1 - t0) / len(drafting)
        sess.timings["tree"] += (t2 - t1) / n
        sess.timings["verify"] += (t3 - t2) / n
        sess.timings["commit"] += (t4 - t3) / n
    return committed


def _groups(sizes: list[int], one_batch: bool) -> list[list[int]]:
    """Indices grouped for verify forwards: one group, or on a CPU groups of similar tree sizes."""
    if not sizes:
        return []
    if one_batch:
        return [list(range(len(sizes)))]
    order = sorted(range(len(sizes)), key=lambda j: -sizes[j])
    groups: list[list[int]] = []
    for j in order:
        if groups:
            group = groups[-1]
            widest = sizes[group[0]]
            real = sum(sizes[g] for g in group) + sizes[j]
            if widest * (len(group) + 1) <= CPU_PADDING_SLACK * real:
                group.append(j)
                continue
        groups.append([j])
    # Sessions keep their given order inside a group, so next round can reuse this round's
    # batched cache as is (_shared_base).
    return [sorted(group) for group in groups]


def _shared_base(tensors: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """[b, h, width, d] over the batched tensor these per-session rows were cut from, if they were.

    That is the steady state: the same sessions in the same order as in the previous round, row i
    of that round's batched cache for session i. Rows past a session's own length hold old but
    finite keys/values, which the mask hides like padding, so no copy is needed. (Tensors made
    under inference_mode do not record their base, so the layout is checked instead.)
    """
    first = tensors[0]
    if first is None:
        return None
    _, heads, _, dim = first.shape
    stride = first.stride()
    if stride[3] != 1 or stride[2] != dim or stride[1] % dim or stride[1] // dim < width \
            or stride[0] < heads * stride[1]:
        return None
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for i, t in enumerate(tensors):
        if t is None or t.untyped_storage().data_ptr() != storage.data_ptr() or t.stride() != stride \
                or t.storage_offset() != offset + i * stride[0]:
            return None
    last = offset + (len(tensors) - 1) * stride[0] + (heads - 1) * stride[1] + (width - 1) * stride[2] + dim
    if last * first.element_size() > storage.nbytes():
        return None
    return first.as_strided((len(tensors), heads, width, dim), stride, offset)


def _pad_stack(tensors: list[torch.Tensor | None], lengths: list[int], width: int,
               like: torch.Tensor) -> torch.Tensor:
    """[1, h, n_i, d] tensors (None when empty) -> [b, h, width, d], padded on the right."""
    shared = _shared_base(tensors, width)
    if shared is not None:
        return shared
    out = like.new_zeros((len(tensors), like.shape[1], width, like.shape[3]))
    for i, (t, n) in enumerate(zip(tensors, lengths)):
        if n:
            out[i, :, :n] = t[0, :, :n]
    return out


def _gather_rows(tensors: list[tuple[torch.Tensor, ...]], moves: list[tuple[int, int, int, list[int]]]) -> None:
    """For each (row, dst, src0, offsets): rows src0+offsets[i] of batch row `row` move to dst+i.

    Sources all lie at or after src0 >= dst and offsets ascend, so no move overwrites a row that a
    later move still reads; the gather also reads everything before it writes.
    """
    batch, dst, src = [], [], []
    for row, to, base, offsets in moves:
        for i, off in enumerate(offsets):
            if to + i != base + off:
                batch.append(row)
                dst.append(to + i)
                src.append(base + off)
    if not batch:
        return
    device = tensors[0][0].device
    b_idx = torch.tensor(batch, device=device)
    d_idx = torch.tensor(dst, device=device)
    s_idx = torch.tensor(src, device=device)
    for pair in tensors:
        for t in pair:
            t[b_idx, :, d_idx] = t[b_idx, :, s_idx]


def _draft(engine: Engine, sessions: list[Session], depths: list[int]):
    """Draft logits [depth_j, V] (float32) per session, from one drafter forward.

    Row j of the drafter input: its cached context (D_j rows, padded to Dmax), its pending features
    (c_j rows, padded to Cmax), then the block [bonus, MASK...]. It sees its own cached and pending
    rows and the whole block, as in the single path (which uses no mask at all). The block is the
    drafter's trained length whatever engine.block_size is (see Session._draft).
    """
    target, drafter = engine.target, engine.drafter
    device = target.device
    b, block = len(sessions), drafter.block_size
    pending = [s._pending for s in sessions]
    ctx = [p.shape[0] for p in pending]
    cached = [s._draft_cache.get_seq_length() for s in sessions]
    cmax, dmax = max(ctx), max(cached)
    feats = pending[0].new_zeros((b, cmax, pending[0].shape[1]))
    for j, p in enumerate(pending):
        feats[j, :ctx[j]] = p
    ids = torch.full((b, block), engine.mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = torch.tensor([s._bonus for s in sessions], device=device)
    cached_t = torch.tensor(cached, device=device)
    ctx_t = torch.tensor(ctx, device=device)
    starts = torch.tensor([s._start for s in sessions], device=device)
    positions = torch.cat((cached_t[:, None] + torch.arange(cmax, device=device),
                           starts[:, None] + torch.arange(block, device=device)), dim=1)
    dtype = target.dtype
    cols = torch.arange(dmax + cmax, device=device)
    visible = (cols[None] < cached_t[:, None]) | ((cols[None] >= dmax) & (cols[None] < dmax + ctx_t[:, None]))
    mask = torch.zeros((b, 1, block, dmax + cmax + block), dtype=dtype, device=device)
    mask[:, 0, :, :dmax + cmax].masked_fill_(~visible[:, None, :], torch.finfo(dtype).min)
    cache: DraftCache = drafter.new_cache()
    if dmax:
        for layer in range(len(cache.keys)):
            keys = [s._draft_cache.keys[layer] for s in sessions]
            values = [s._draft_cache.values[layer] for s in sessions]
            like = next(k for k in keys if k is not None)
            cache.keys[layer] = _pad_stack(keys, cached, dmax, like)
            cache.values[layer] = _pad_stack(values, cached, dmax, like)
    hidden = drafter(target.embed(ids), feats, positions, mask, cache)
    rows = torch.cat([hidden[j, 1:1 + d] for j, d in enumerate(depths)])
    logits = target.lm_head(rows).float().split(depths)
    return list(logits), (cache, cached, ctx, dmax)


def _commit_draft_caches(sessions: list[Session], cache: DraftCache, cached: list[int], ctx: list[int],
                         dmax: int) -> None:
    """Move each row's new context K/V next to its cached rows; hand each session its view."""
    tensors = list(zip(cache.keys, cache.values))
    _gather_rows(tensors, [(j, cached[j], dmax, list(range(ctx[j]))) for j in range(len(sessions))])
    for j, sess in enumerate(sessions):
        end = cached[j] + ctx[j]
        sess._draft_cache.keys = [k[j:j + 1, :, :end] for k in cache.keys]
        sess._draft_cache.values = [v[j:j + 1, :, :end] for v in cache.values]


def _verify(engine: Engine, sessions: list[Session], trees: list[Tree]):
    """One target forward over every session's tree. Returns (logits [b, Q, V] in the model dtype,
    features [b, Q, K*H] or None, the batched cache's per-layer (k, v), Lmax)."""
    target = engine.target
    device, dtype = target.device, target.dtype
    neg = torch.finfo(dtype).min
    b = len(sessions)
    sizes = [t.size for t in trees]
    width = max(sizes)
    starts = [s._start for s in sessions]
    lmax = max(starts)
    ids = torch.zeros((b, width), dtype=torch.long, device=device)
    starts_t = torch.tensor(starts, device=device)
    positions = starts_t[:, None].expand(b, width).clone()
    visible = torch.eye(width, dtype=torch.bool, device=device).repeat(b, 1, 1)
    for j, tree in enumerate(trees):
        n = sizes[j]
        ids[j, :n] = tree.tokens
        positions[j, :n] += tree.depths
        visible[j, :n, :n] = tree.ancestors()
    mask = torch.zeros((b, 1, width, lmax + width), dtype=dtype, device=device)
    context = torch.arange(lmax, device=device)[None] < starts_t[:, None]
    mask[:, 0, :, :lmax].masked_fill_(~context[:, None, :], neg)
    mask[:, 0, :, lmax:].masked_fill_(~visible, neg)
    layers = [s._cache.tensors() for s in sessions]
    stacked = []
    for layer in range(len(layers[0])):
        keys = [per[layer][0] for per in layers]
        values = [per[layer][1] for per in layers]
        stacked.append((_pad_stack(keys, starts, lmax, keys[0]), _pad_stack(values, starts, lmax, values[0])))
    cache = KVCache.of(target.model, stacked)
    features = any(s.mode != "ar" for s in sessions)
    out = target.forward_batch(ids, positions, cache, mask, features=features)
    return out.logits, out.features, cache.tensors(), lmax
