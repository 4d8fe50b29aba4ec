"""Batched rounds of the fast backend: many sessions in one drafter and one target forward, read
in place from the KV pool (fast/pool.py).

Running sessions hold pool slots; slots are leased lowest first, so a round over b' sessions whose
highest slot is b-1 runs every forward over slots 0..b-1 as one batch. A slot that has no part
in the round (free, or its session is not in it) rides along as a dummy row: it writes its K/V at
its own length and beyond, rows no query sees until a real token is written there (the pool's
invariant, as for a single cache's padding), and its outputs are never read. So no context K/V is
stacked, padded or copied: attention reads pool[layer, :b, :, :span] as a view, each row masked
to its own context (its length in `pool.lengths`) and, among the new rows, its own tree.

A round mixes AR steps, DFlash chains and DDTree trees of any budgets: each row's tree is built
on the device (fast/batch_tree.py, rows of one budget and depth in one build) and padded to a
common query bucket q; padded nodes carry token -1 and see only themselves, so the walk never
accepts one. The walks of every row come to the host in one transfer. Then one gather and one
scatter move every row's accepted K/V into place, and one write sets every length.

The rounds are lossless the same way the single path is: every committed token is the target's
choice at its true prefix, from the same inputs; a batched GEMM only rounds differently, which
matters at a true tie of the top two logits. If the batched round raises, the lengths are put back
and no session in it has changed (the scheduler then steps each session alone); the prompt
appends before it (step_many) have happened by then, and the new sessions whose packed prefill
went in before it are new again (their first tokens are read after the round, _prefill).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast.batch_tree import (
    TreeBatch,
    build_trees_device,
    chains_device,
    fetch_walks,
    pad_batch,
    roots_only,
    walk_batch,
)
from ddtree.engine.reference.fast import tree_attention as fused
from ddtree.engine.reference.fast.cache import kv_bucket
from ddtree.engine.reference.fast.draft import _apply_rope
from ddtree.engine.reference.fast.graphs import record_graph
from ddtree.engine.reference.fast.model import BatchPlan

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine
    from ddtree.engine.reference.fast.pool import KVPool
    from ddtree.engine.reference.fast.target import FastTarget

# Logits computed at once for a greedy argmax (argmax_rows): bounds the [rows, V] block (a 64-row
# batch of budget-64 trees over a 152k vocabulary would otherwise want 2.5 GB in float32).
_LOGIT_ELEMENTS = 1 << 26


def _lone_round(engine: Engine, session: Session) -> bool:
    """Whether the one running session on the pool takes the batched round (a batch of one)
    rather than stepping alone: where its slot has no graphs of its own (past the backend's
    graphed slots) and rounds on the pool are graphed, alone would run its forward eagerly.
    On an H200's 1.7B that was 33-37 ms where a round is 2.5 (a c=16 point's last request).
    A lone AR session on a graphed slot keeps its own graphs: on an H100's 1.7B the pool's b=1
    round, run ahead, took 2.00 ms a token through the server against 1.95 on the slot's graphs,
    and 1.86 once the slot's next step ran ahead too (fast/step_ahead.py; bench/RESULTS.md)."""
    impl = engine.impl
    return (impl.graphs or impl.batch_static) and not session._cache.graphs


def step_many(engine: Engine, sessions: list[Session]) -> list[list[int]]:
    """One round of every session (Engine.step_many's contract): the new sessions' prefills, then one
    batched round over the prefilled sessions on pool slots; the others step alone. With mixed
    chunks (engine.mixed_chunk) and a graphed round to ride, new sessions' next chunks go
    into that round instead, and the other new sessions wait (fast/ride.py). Engine.step_many
    has checked that the sessions are distinct and this engine's."""
    t0 = time.perf_counter()
    out: list[list[int]] = [[] for _ in sessions]
    pool = engine.impl.pool
    new, pooled, alone = [], [], []
    for i, sess in enumerate(sessions):
        if sess.done:
            continue
        if sess._bonus is None:
            new.append(i)
        elif pool is not None and pool.index_of(sess._cache) is not None:
            pooled.append(i)
        else:
            alone.append(i)
    if pool is not None:
        engine.impl.joining.update(id(sessions[i]) for i in new)
    if len(pooled) == 1 and not _lone_round(engine, sessions[pooled[0]]):
        alone += pooled
        pooled = []
    if pooled or new:
        # A batched round writes past the length of every slot below its batch, as inactive
        # rows: a lone step run ahead must not be booked over that (fast/step_ahead.py).
        engine.impl.steps.drop()
    kind = riders = None
    burst = False
    waiting = 0  # new sessions that wait a turn behind a round run ahead
    if pooled:
        from ddtree.engine.reference.fast import batch_graph

        members = [sessions[i] for i in pooled]
        for s in members:  # a draft step run ahead while one stepped alone is not this round's
            if s._draft_cache is not None:
                engine.impl.drafts.settle(s._draft_cache)
        append_prompts(engine, members)
        impl = engine.impl
        kind = batch_graph.eligible(engine, members) if (impl.graphs or impl.batch_static) else None
        # A round already run ahead for these sessions is this turn's. New sessions cannot ride
        # in a round that has run: with mixed chunks they wait a turn (so no running stream
        # waits for a prefill of their own), else they prefill beside it.
        taking = kind is not None and batch_graph.takes_ahead(engine, members, kind)
        if not taking:
            batch_graph.drop_ahead(engine)
        if kind is not None and new and not taking:
            riders, burst = _riders(engine, members, [sessions[i] for i in new], kind)
        if taking and new and engine.mixed_chunk:
            from ddtree.engine.reference.fast import ride

            if ride.riders_run(engine):
                waiting, new = len(new), []
                engine.turn_note = "ahead, new wait"

    marks = {"decided": time.perf_counter()}

    def advance() -> None:  # the running sessions' round, and those that step alone
        marks["round"] = time.perf_counter()
        if pooled:
            with torch.inference_mode():
                if kind is not None:
                    # No round runs ahead of one that a session prefilled since the last round
                    # (here, or in a call of its own) will join.
                    ahead = impl.joining <= {id(s) for s in members}
                    results, ridden = batch_graph.graphed_round(engine, members, kind, graphs=impl.graphs,
                                                                riders=riders, ahead=ahead)
                    impl.joining.clear()
                    for s, tokens in zip(riders[0] if riders else [], ridden):
                        out[sessions.index(s)] = tokens
                else:
                    results = batched_round(engine, members)
                    impl.joining.clear()
            for i, tokens in zip(pooled, results):
                out[i] = tokens
        for i in alone:
            out[i] = sessions[i].step()
        marks["firsts"] = time.perf_counter()

    if riders is None or burst:
        # What prefills on its own is capped (a rider's chunk is bounded by its shape instead,
        # and counts first).
        ridden = riders[0] if riders else []
        ridden_ids = {id(r) for r in ridden}
        rest = [i for i in new if id(sessions[i]) not in ridden_ids]
        held = engine.held_by_prefill_cap(ridden + [sessions[i] for i in rest]) - ridden_ids
        engine.turn_held = len(held) + waiting
        new = [i for i in new if id(sessions[i]) not in held]
        rest = [i for i in rest if id(sessions[i]) not in held]
        for i, tokens in zip(rest, _prefill(engine, [sessions[i] for i in rest], then=advance)):
            out[i] = tokens
        marks["after"] = time.perf_counter()
    else:  # the riders' chunks are this turn's prefill work; the other new sessions wait a turn
        advance()
    if pool is not None:
        # A prompt's drafter rows go in with its prefill, as SGLang's draft extend runs with the
        # target's: their eager forwards count in the first token's time, not in the gap to the
        # second (which held DDTree's in-process ITL p99 at 2.6x its p50 on an H200).
        started = [sessions[i] for i in new]
        append_prompts(engine, [s for s in started if s._bonus is not None and not s.done
                                and pool.index_of(s._cache) is not None])
    engine.impl.refresh_usage()
    if new and (pooled or alone) and "after" in marks:
        # Where a turn of prefills beside a round spent its host time: deciding (riders, the
        # members' appends), launching the prefill, the round (its launch and its wait), reading
        # the first tokens, and the new sessions' drafter appends after.
        ends = [t0, marks["decided"], marks["round"], marks["firsts"], marks["after"], time.perf_counter()]
        engine.turn_parts = {name: b - a for name, a, b in
                             zip(("decide", "launch", "round", "firsts", "after"), ends, ends[1:])}
    return out


def _riders(engine: Engine, members: list[Session], new: list[Session], kind: tuple):
    """(riders, burst): the new sessions whose next prefill chunks ride in this graphed round of
    `members` and their shape (fast/ride.py), or None, those whose prompt is part in already
    first; and whether the others are a burst, which prefills beside the round. A burst's
    riders are only those part in: the packed prefill starts every prompt at row 0, and one
    left to Session.step() would prefill its rest alone, after the round, outside any graph
    (a burst turn at concurrency 16 on an H100 took 32-40 ms instead of about 10, bench/RESULTS.md)."""
    from ddtree.engine.reference.fast import batch_graph, ride

    if not ride.riders_run(engine):
        return None, False
    started = [s for s in new if s._prefilled_rows > 0]
    b, q = batch_graph.round_shape(engine, members, kind)
    if ride.burst(engine, new, ride.shapes(engine, b * q)):
        picked = ride.pick(engine, started, b * q, q, burst_check=False) if started else None
        engine.turn_note = "burst" if picked is None else "burst, riders {}x{}".format(*picked[1])
        return picked, True
    picked = ride.pick(engine, started + [s for s in new if s._prefilled_rows == 0], b * q, q, burst_check=False)
    if picked is not None:
        engine.turn_note = "riders {}x{}".format(*picked[1])
    return picked, False


def _prefill(engine: Engine, sessions: list[Session], then: Callable[[], None]) -> list[list[int]]:
    """New sessions' prefills, with `then` (the turn's running round) run once in their midst: on
    pool slots where graphs run, a turn's prompts together as batched graph replays, the round
    launched before their first tokens are read (fast/prefill.py); else, and always for a
    prefill in chunks, each through Session.step()'s own causal forward, after the round."""
    impl = engine.impl
    out: list[list[int] | None] = [None] * len(sessions)
    staged = [j for j, s in enumerate(sessions)
              if (impl.graphs or impl.batch_static) and impl.pool is not None and not s.chunked_prefill
              and impl.pool.index_of(s._cache) is not None]
    if staged:
        from ddtree.engine.reference.fast.prefill import prefill_many

        firsts = prefill_many(engine, [sessions[j] for j in staged], graphs=impl.graphs, then=then)
        for j, committed in zip(staged, firsts):
            out[j] = committed
    else:
        then()
    return [s.step() if committed is None else committed for s, committed in zip(sessions, out)]


def batched_round(engine: Engine, sessions: list[Session]) -> list[list[int]]:
    """Draft, build, verify, walk and commit every session's round in one batch."""
    impl, target = engine.impl, engine.target
    pool: KVPool = impl.pool
    slots = [pool.index_of(s._cache) for s in sessions]
    b = max(slots) + 1
    lengths = pool.lengths.clone()
    dlengths = pool.dlengths.clone() if pool.dlengths is not None else None
    draft_host = [s._draft_cache.length if s._draft_cache is not None else 0 for s in sessions]
    t0 = engine.clock()
    try:
        depths = [s._depth_cap() for s in sessions]
        drafting = [j for j, s in enumerate(sessions) if s.mode != "ar" and depths[j] > 0]
        draft_logits: dict[int, torch.Tensor] = {}
        if drafting:
            logits = draft_rows(engine, [sessions[j] for j in drafting], [slots[j] for j in drafting],
                                [depths[j] for j in drafting], b)
            draft_logits = dict(zip(drafting, logits))
        t1 = engine.clock()
        trees, order = _trees(engine, sessions, draft_logits)
        t2 = engine.clock()
        rows = [slots[j] for j in order]
        starts = [sessions[j]._start for j in order]
        features = any(sessions[j].mode != "ar" for j in order)
        hidden, feats = verify_rows(engine, pool, b, rows, trees, starts, features)
        posterior = _posterior(engine, [sessions[j] for j in order], hidden, rows, trees)
        walk_order, count = walk_batch(trees, posterior)
        walks = fetch_walks(trees, posterior, walk_order, count)  # the round's one host sync
        t3 = engine.clock()
        _commit_rows(pool, rows, starts, [w[0] for w in walks])
    except BaseException:
        pool.lengths.copy_(lengths)
        if dlengths is not None:
            pool.dlengths.copy_(dlengths)
        for s, n in zip(sessions, draft_host):
            if s._draft_cache is not None:
                s._draft_cache.length = n
        raise
    q = trees.tokens.shape[1]
    accepted = None
    if feats is not None:
        flat = [r * q + i for r, (path, _) in zip(rows, walks) for i in path]
        accepted = feats.index_select(0, torch.tensor(flat, device=feats.device))
    committed: list[list[int]] = [[] for _ in sessions]
    at = 0
    target._last = target.staged = None
    impl._staged_tree = impl._parents_staged = None
    for k, j in enumerate(order):
        sess = sessions[j]
        path_list, new = walks[k]
        tau = len(path_list)
        sess._cache.length = starts[k] + tau
        sess._cache.moved = None
        mine = accepted[at:at + tau] if accepted is not None and sess.mode != "ar" else None
        at += tau
        committed[j] = sess._advance(path_list, new, mine, drafted=j in draft_logits)
    t4 = engine.clock()
    n = len(sessions)
    for j, sess in enumerate(sessions):
        # Batch time is shared: each session books its share, so sums over sessions stay true.
        if j in draft_logits:
            sess.timings["draft"] += (t1 - t0) / len(draft_logits)
        sess.timings["tree"] += (t2 - t1) / n
        sess.timings["verify"] += (t3 - t2) / n
        sess.timings["commit"] += (t4 - t3) / n
    return committed


# ---- the drafter ------------------------------------------------------------------------------
def append_prompts(engine: Engine, sessions: list[Session]) -> None:
    """Prompts' features (pending after a prefill) go into their drafter rows before the batched
    round, prompts of similar lengths in one forward (append_groups): the sessions that joined in
    a turn append together, not one eager forward each. Padding every row of the round's own
    append to a prompt's length would multiply its work, so the first draft then appends nothing,
    as the single path's would after a prompt."""
    drafts = engine.impl.drafts
    if drafts is None:
        return
    todo = [s for s in sessions if s.mode != "ar" and s._pending is not None and s._pending.shape[0] > drafts.block_size]
    for group in append_groups([s._pending.shape[0] for s in todo]):
        members = [todo[j] for j in group]
        with torch.inference_mode():
            if len(members) == 1:
                drafts.append(members[0]._pending, members[0]._draft_cache)
            else:
                _append_together(engine, members)
        for s in members:
            s._pending = s._pending[:0]


# A batched prompt append: padded rows at most, and at most this much padding over its real rows.
_APPEND_ROWS = 8192
_APPEND_SLACK = 2


def append_groups(counts: list[int]) -> list[list[int]]:
    """Indices of these row counts grouped for batched appends, longest first."""
    groups: list[list[int]] = []
    real = 0
    for j in sorted(range(len(counts)), key=lambda j: -counts[j]):
        if groups:
            widest = counts[groups[-1][0]]
            padded = widest * (len(groups[-1]) + 1)
            if padded <= _APPEND_ROWS and padded <= _APPEND_SLACK * (real + counts[j]):
                groups[-1].append(j)
                real += counts[j]
                continue
        groups.append([j])
        real = counts[j]
    return groups


def _append_together(engine: Engine, sessions: list[Session]) -> None:
    """These pool sessions' pending features into their drafter slots in one append_context."""
    drafts = engine.impl.drafts
    pool: KVPool = engine.impl.pool
    device = pool.lengths.device
    counts = [int(s._pending.shape[0]) for s in sessions]
    for s, c in zip(sessions, counts):
        cache = s._draft_cache
        if cache.length + c > cache.capacity:
            raise BadParams(f"drafter cache full: {cache.length} + {c} rows exceed capacity "
                            f"{cache.capacity}", "build the FastDrafter with a larger capacity")
    feats = torch.zeros((len(sessions), max(counts), drafts.feature_width), dtype=drafts.dtype, device=device)
    for j, s in enumerate(sessions):
        feats[j, :counts[j]] = s._pending.to(drafts.dtype)
    slots = torch.tensor([pool.index_of(s._cache) for s in sessions], device=device)
    append_context(engine, feats, torch.tensor(counts, device=device), slots)
    for s, c in zip(sessions, counts):
        s._draft_cache.length += c


def draft_rows(engine: Engine, sessions: list[Session], slots: list[int], depths: list[int],
               b: int) -> list[torch.Tensor]:
    """Each session's draft logits [depth, V] float32: its pending features appended to its
    drafter rows, then the block [bonus, MASK...] of every slot 0..b-1 in one forward."""
    drafts = engine.impl.drafts
    pool: KVPool = engine.impl.pool
    device = pool.lengths.device
    block = drafts.block_size
    pending = [s._pending for s in sessions]
    counts = [int(p.shape[0]) for p in pending]
    widest = max(counts)
    if widest:
        _append_rows(engine, pool, sessions, slots, pending, counts, widest, b)
    for s, c in zip(sessions, counts):
        s._draft_cache.length += c
    span = max(s._draft_cache.length for s in sessions) + block
    ids = torch.full((b, block), engine.mask_token_id, dtype=torch.long, device=device)
    ids[torch.tensor(slots, device=device), 0] = torch.tensor([s._bonus for s in sessions],
                                                              dtype=torch.long, device=device)
    hidden = draft_block(engine, ids, span).view(b * block, -1)
    picks = [r * block + 1 + i for r, depth in zip(slots, depths) for i in range(depth)]
    logits = drafts.lm_head(hidden.index_select(0, torch.tensor(picks, device=device))).float()
    return list(logits.split(depths))


def draft_block(engine: Engine, ids: torch.Tensor, span: int) -> torch.Tensor:
    """The drafter's block forward for slots 0..b-1: ids [b, B] at each slot's positions
    length..length+B-1, attending over its context and its own block (rows [:span] of every slot
    read in place, each masked to its own length). Returns the final hidden [b, B, H]."""
    drafts = engine.impl.drafts
    pool: KVPool = engine.impl.pool
    device = pool.lengths.device
    b, block = ids.shape
    span = min(span, pool.dk.shape[3])
    lengths = pool.dlengths[:b]
    positions = lengths[:, None] + torch.arange(block, device=device)        # [b, B]
    slot_rows = torch.arange(b, device=device)[:, None].expand(b, block)
    visible = None
    if drafts.attention != "triton":
        visible = (torch.arange(span, device=device)[None] < (lengths + block)[:, None])[:, None, None, :]
    x = drafts.embed(ids.reshape(-1))
    cos, sin = drafts._rope(positions.reshape(-1), x.dtype)
    heads, kvh, g, d = drafts.num_heads, drafts.num_kv_heads, drafts.groups, drafts.head_dim
    n = b * block
    for i, layer in enumerate(drafts.drafter.layers):
        attn = layer.self_attn
        q, k, v = drafts.qkv(i, layer.input_layernorm(x))
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        keys, values = pool.dk[i], pool.dv[i]
        keys[slot_rows, :, positions] = k.view(b, block, kvh, d)
        values[slot_rows, :, positions] = v.view(b, block, kvh, d)
        if drafts.attention == "triton":  # each row's block follows its own context length
            out = fused.tree_attention(q, keys[:b], values[:b], lengths, None, drafts.scaling, span)
            out = out.view(n, heads * d)
        else:
            folded = q.view(b, block, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * block, d)
            out = F.scaled_dot_product_attention(folded, keys[:b, :, :span], values[:b, :, :span],
                                                 attn_mask=visible, scale=drafts.scaling)
            out = out.view(b, kvh, g, block, d).permute(0, 3, 1, 2, 4).reshape(n, heads * d)
        x = x + drafts.linear(attn.o_proj, out)
        x = x + drafts.mlp(i, layer.post_attention_layernorm(x))
    return drafts.drafter.norm(x).view(b, block, -1)


def _append_rows(engine: Engine, pool: KVPool, sessions, slots, pending, counts, widest: int,
                 b: int) -> None:
    """Stage every row's pending features [b, widest, F] (zeros where a slot has no part), then
    append_context."""
    drafts = engine.impl.drafts
    device = pool.lengths.device
    feats = torch.zeros((b, widest, drafts.feature_width), dtype=drafts.dtype, device=device)
    count = torch.zeros(b, dtype=torch.long, device=device)
    for slot, p, c in zip(slots, pending, counts):
        if c:
            feats[slot, :c] = p.to(drafts.dtype)
    count[torch.tensor(slots, device=device)] = torch.tensor(counts, device=device)
    append_context(engine, feats, count)


def append_context(engine: Engine, feats: torch.Tensor, count: torch.Tensor,
                   slots: torch.Tensor | None = None) -> None:
    """The drafter's context step for slots 0..b-1 (or these distinct slots [b]): the first
    count[r] rows of feats [b, A, F] become row r's slot's context K/V at its own length, and its
    length grows by count[r]. Pad rows (and slots with count 0) all write the slots' scratch row,
    past every context."""
    drafts = engine.impl.drafts
    pool: KVPool = engine.impl.pool
    device = pool.lengths.device
    b, widest = feats.shape[0], feats.shape[1]
    if slots is None:
        slots = torch.arange(b, device=device)
        lengths = pool.dlengths[:b]
    else:
        lengths = pool.dlengths.index_select(0, slots)
    steps = torch.arange(widest, device=device)
    positions = lengths[:, None] + steps                                   # [b, widest]
    scratch = pool.dk.shape[3] - 1
    rows = torch.where(steps[None] < count[:, None], positions, torch.full_like(positions, scratch))
    slot_rows = slots[:, None].expand(b, widest)
    ctx, cos, sin = drafts._project(feats.reshape(b * widest, -1), positions.reshape(-1))
    kvh, d = drafts.num_kv_heads, drafts.head_dim
    for i, layer in enumerate(drafts.drafter.layers):
        k, v = drafts._context_kv(i, ctx, cos, sin)
        pool.dk[i][slot_rows, :, rows] = k.view(b, widest, kvh, d)
        pool.dv[i][slot_rows, :, rows] = v.view(b, widest, kvh, d)
    pool.dlengths.index_add_(0, slots, count)


# ---- trees ------------------------------------------------------------------------------------
def _trees(engine: Engine, sessions: list[Session], draft_logits: dict[int, torch.Tensor]
           ) -> tuple[TreeBatch, list[int]]:
    """Every session's tree padded to one query bucket, and the session index of each row."""
    device = engine.target.device
    groups: dict[tuple, list[int]] = {}
    for j, sess in enumerate(sessions):
        if j not in draft_logits:
            key = ("root",)
        elif sess.mode == "chain":
            key = ("chain", int(draft_logits[j].shape[0]))
        else:
            key = ("tree", int(sess.spec.budget), int(draft_logits[j].shape[0]))
        groups.setdefault(key, []).append(j)
    parts, order = [], []
    for key, members in groups.items():
        roots = torch.tensor([sessions[j]._bonus for j in members], dtype=torch.long, device=device)
        if key[0] == "root":
            parts.append(roots_only(roots))
        else:
            logits = torch.stack([draft_logits[j] for j in members])
            if key[0] == "chain":
                parts.append(chains_device(roots, logits))
            else:
                parts.append(build_trees_device(roots, torch.log_softmax(logits, dim=-1), key[1]))
        order += members
    widest = max(max(p.sizes) for p in parts)
    q = next((size for size in engine.target.buckets if size >= widest), widest)
    return pad_batch(parts, q), order


# ---- the target -------------------------------------------------------------------------------
def verify_rows(engine: Engine, pool: KVPool, b: int, rows: list[int], trees: TreeBatch,
                starts: list[int], features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over slots 0..b-1; row rows[k] carries trees row k at positions
    starts[k] + depth. Returns the final hidden [b*q, H] and the feature layers' [b*q, K*H]."""
    target = engine.target
    device = target.device
    q = trees.tokens.shape[1]
    row_t = torch.tensor(rows, device=device)
    ids = torch.zeros((b, q), dtype=torch.long, device=device)
    ids[row_t] = trees.tokens.clamp(min=0)
    lengths = pool.lengths[:b]
    positions = lengths[:, None].expand(b, q).clone()
    positions[row_t] += trees.depths
    tree = torch.eye(q, dtype=torch.bool, device=device).repeat(b, 1, 1)
    tree[row_t] = trees.visible
    span = max(starts) + q
    if target.bucket_kv:
        span = kv_bucket(target.new_cache_rows(), span)
    plan = batch_plan(target, lengths, tree, span)
    layers = target.feature_layers if features else ()
    hidden, feats = target.model(ids.view(-1), positions.view(-1), pool.k, pool.v, plan, layers)
    if features and feats is None:
        feats = hidden.new_zeros((hidden.shape[0], 0))
    return hidden, feats


def batch_plan(target, lengths: torch.Tensor, tree: torch.Tensor, span: int) -> BatchPlan:
    """Where b rows of q new tokens go (each slot's length onward) and what each query sees:
    its row's context (rows < length) and, among the new rows, what `tree` [b, q, q] allows."""
    b, q = tree.shape[0], tree.shape[1]
    device = lengths.device
    steps = torch.arange(q, device=device)
    slots = torch.arange(b, device=device)[:, None].expand(b, q)
    if target.attention == "triton":  # the kernel reads the lengths and trees itself: no mask
        return BatchPlan(b=b, q=q, slots=slots, rows=lengths[:, None] + steps, read=span, mask=None,
                         kernel="triton", lengths=lengths, tree=tree)
    rel = torch.arange(span, device=device)[None] - lengths[:, None]         # [b, S]
    among = (rel >= 0) & (rel < q)
    cols = tree.gather(2, rel.clamp(0, q - 1)[:, None, :].expand(b, q, span))  # [b, q, S]
    seen = (rel < 0)[:, None, :] | (among[:, None, :] & cols)
    dtype = torch.float32 if target.attention == "matmul" else target.dtype
    additive = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
    groups = target.cfg.num_attention_heads // target.cfg.num_key_value_heads
    if groups > 1:
        additive = additive.repeat(1, groups, 1)
    return BatchPlan(b=b, q=q, slots=slots, rows=lengths[:, None] + steps, read=span, mask=additive[:, None],
                     kernel=target.attention)


def _posterior(engine: Engine, sessions: list[Session], hidden: torch.Tensor, rows: list[int],
               trees: TreeBatch) -> torch.Tensor:
    """The target's choice at every real node [rows, q] (-1 at padding): the argmax for greedy
    sessions, in blocks of rows; a sampling session draws from its own generator."""
    target = engine.target
    q = trees.tokens.shape[1]
    out = torch.full((len(rows), q), -1, dtype=torch.long, device=hidden.device)
    greedy = [k for k, s in enumerate(sessions) if s.gen.greedy]
    flat = [rows[k] * q + i for k in greedy for i in range(trees.sizes[k])]
    if flat:
        index = torch.tensor(flat, device=hidden.device)
        dest = torch.tensor([k * q + i for k in greedy for i in range(trees.sizes[k])], device=hidden.device)
        out.view(-1).index_copy_(0, dest, argmax_rows(target, hidden, index))
    for k, sess in enumerate(sessions):
        if not sess.gen.greedy:
            n = trees.sizes[k]
            logits = target.lm_head(hidden[rows[k] * q:rows[k] * q + n]).float()
            out[k, :n] = sess._choose(logits)
    return out


def argmax_rows(target: FastTarget, hidden: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """The target's greedy choice [n] (long) at n rows of hidden [rows, H]: all rows, or the rows
    `index` [n] names. The logits are made in blocks of rows, so no more than _LOGIT_ELEMENTS of
    them sit in memory at once. The argmax is of the model-dtype logits, which is that of their
    float32 copy (the cast is exact and keeps the order, ties included). Shapes and the blocks
    follow from the arguments alone and nothing syncs the host, so a graph capture may run this
    (batch_graph.static_round)."""
    n = hidden.shape[0] if index is None else index.shape[0]
    step = max(1, _LOGIT_ELEMENTS // target.vocab_size)
    picks = []
    for at in range(0, n, step):
        block = hidden[at:at + step] if index is None else hidden.index_select(0, index[at:at + step])
        picks.append(target.lm_head(block).argmax(dim=-1))
    return torch.cat(picks)


def _commit_rows(pool: KVPool, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
    """Move each row's accepted K/V rows to sit right after its context (one gather and one
    scatter over every layer and row), then set every length in one write."""
    device = pool.lengths.device
    slot, dst, src = [], [], []
    for r, start, path in zip(rows, starts, paths):
        for i, node in enumerate(path):
            if node != i:
                slot.append(r)
                dst.append(start + i)
                src.append(start + node)
    if slot:
        s = torch.tensor(slot, device=device)
        d = torch.tensor(dst, device=device)
        moved_k = pool.k[:, s, :, torch.tensor(src, device=device)]       # [m, layers, kv_heads, d]
        moved_v = pool.v[:, s, :, torch.tensor(src, device=device)]
        pool.k[:, s, :, d] = moved_k
        pool.v[:, s, :, d] = moved_v
    pool.lengths[torch.tensor(rows, device=device)] = torch.tensor(
        [start + len(path) for start, path in zip(starts, paths)], device=device)


# ---- timing (bench/bench_server.py) -----------------------------------------------------------
def verify_timing(engine: Engine, b: int, q: int, context: int, repeats: int = 10) -> float:
    """Median ms of one batched target forward (and argmax) of b rows x q tokens over `context`
    rows each, replayed as a CUDA graph on CUDA (random weights give the cost for any
    acceptance). Its K/V writes land past `context`; the lengths are put back afterwards."""
    pool = engine.impl.pool
    if pool is None or b > pool.slots:
        raise BadParams(f"verify timing needs a KV pool of at least {b} slots")
    usage = engine.impl.pool_usage()
    if usage is not None and usage["used_slots"]:
        raise BadParams("verify timing writes into the pool's slots: run it on an engine with no sessions")
    target = engine.target
    device = target.device
    saved = pool.lengths.clone()
    pool.lengths[:b] = context
    tokens = torch.zeros((b, q), dtype=torch.long, device=device)
    depths = torch.arange(q, device=device).expand(b, q)
    visible = torch.ones((q, q), dtype=torch.bool, device=device).tril().expand(b, q, q)
    times = []
    tree = visible.contiguous()
    span = context + q
    if target.bucket_kv:
        span = kv_bucket(target.new_cache_rows(), span)
    positions = (context + depths).reshape(-1)

    def forward():
        plan = batch_plan(target, pool.lengths[:b], tree, span)
        hidden, _ = target.model(tokens.view(-1), positions, pool.k, pool.v, plan, ())
        return target.lm_head(hidden).argmax(dim=-1)
    try:
        with torch.inference_mode():
            run = forward
            if device.type == "cuda":
                # Timed as the rounds run it: one graph replay (eager, the launches dominate).
                run = record_graph(forward, None, device, 1)[0].replay
            for _ in range(repeats + 2):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
    finally:
        pool.lengths.copy_(saved)
    return statistics.median(times[2:]) * 1000.0
