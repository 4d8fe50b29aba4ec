"""A whole batched round as one CUDA graph, for the rounds a load test is made of: every session
greedy, one algorithm, one budget (fast/batch.py runs every other mix eagerly).

One replay does what fast/batch.py does step by step, over slots 0..b-1 (b a power of two):
append each row's staged features to its drafter rows, draft the block, build the trees, verify
them in one target forward, take the argmax, walk, move the accepted K/V rows into place, add
the accepted lengths, and stage what the next round needs (its bonus, and the accepted rows'
features, which the next append reads where they are). The host then reads one packed tensor.

Every shape follows from the key (mode, budget, b, span), so a graph per key serves any round
with those; nothing in the replay reads a host value. Rows are told apart by `active`: a row
whose slot has no part in the round (free, or its session not in it) still computes, but its
lengths, staged features and bonus stay as they were and its K/V writes land past its length,
where no query looks (the pool's invariant). Capture runs with every row inactive, so it may
happen between any two rounds of a live server.

A row's tree may be deeper than its session may go (Session._depth_cap: tokens still wanted, the
context window): nodes past the row's cap get token -1 and are never accepted. So the committed
tokens are still the target's greedy choices, exactly what plain decoding gives; only the tree
differs from the one the single path would build at that cap, which changes no output.

The next round runs ahead of the host (FastPath.round_ahead): a graphed round leaves every input
of the next one on the device (the lengths, each row's bonus and, drafting, its accepted features
and their count) but the depth caps, which the host sets so that the round never writes past the
window (Session._depth_cap as if the round in flight accepted all it may). So right after its
replay the next round's is queued too, before the host waits for this one's result.
The GPU then runs round k+1 while the host books round k, streams it and comes back; the next
graphed_round over the same sessions (or some of them: the others finished) takes that round's
result instead of launching one. Rows whose session reaches its length limit in round k are
inactive in it; a session that stops on a token wastes one row of work, never a token. Anything
else (another round mix, new sessions joining the round, a session stepping alone) first drops it:
the sessions still on their slots get their lengths and staged rows back (drop_ahead), device-side.

On a CPU the same function runs without a graph (FastPath.batch_static, for tests). A graphed
round is one replay, so its phases cannot be told apart on the host: its time is booked as
verify in each session's timings.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.fast.batch import _lone_round, append_context, argmax_rows, batch_plan, draft_block
from ddtree.engine.reference.fast.batch_tree import (
    TreeBatch,
    build_trees_device,
    chains_device,
    pack_walks,
    pad_batch,
    roots_only,
    unpack_walks,
    walk_batch,
)
from ddtree.engine.reference.fast import ride
from ddtree.engine.reference.fast.cache import kv_bucket
from ddtree.engine.reference.fast.graphs import Staging, record_graph

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine
    from ddtree.engine.reference.fast.pool import KVPool

_WARMUP_RUNS = 2


@dataclass
class Ahead:
    """A round queued before the host read the one before it (see the module docstring)."""
    key: tuple
    lane: int                                      # which of the stage's two read-backs it uses
    rows: dict[int, tuple[weakref.ref, int, int]]  # slot -> (its session, its verify count then, depth cap)
    # Device copies from before it: the pool's lengths, the drafter's, and the stage's bonus,
    # feature counts and features (None where there is no drafter).
    saved: tuple
    packed: torch.Tensor | None = None             # without graphs: its result, computed already


class RoundStage:
    """The buffers every round graph of one pool reads and writes (graphs bake their addresses)."""

    def __init__(self, engine: Engine, pool: KVPool) -> None:
        slots, device = pool.slots, pool.lengths.device
        drafts = engine.impl.drafts
        self.bonus = torch.zeros(slots, dtype=torch.long, device=device)
        self.cap = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.staging = (Staging(self.active), Staging(self.cap))
        self.count = torch.zeros(slots, dtype=torch.long, device=device)   # staged feature rows
        self.feats = None
        if drafts is not None:
            self.feats = torch.zeros((slots, drafts.block_size, drafts.feature_width),
                                     dtype=drafts.dtype, device=device)
        # slot -> (session id, its verify count) whose bonus and features the stage holds after
        # a graphed round; any other round of that session since makes the entry stale.
        self.holds: dict[int, tuple[int, int]] = {}
        self.graphs: dict[tuple, tuple[object, torch.Tensor]] = {}
        self.graph_pool = None
        # (key, lane) -> pinned copy of its packed walks; an event a lane: a round and the one
        # run ahead of it are read back through different lanes.
        self.host: dict[tuple, torch.Tensor] = {}
        self.done = [torch.cuda.Event(), torch.cuda.Event()] if device.type == "cuda" else None
        self.ahead: Ahead | None = None
        self.ahead_counts = {"launched": 0, "taken": 0, "dropped": 0}
        self.riders: dict[tuple[int, int], ride.RiderStage] = {}  # shape -> its buffers (fast/ride.py)
        self._engine = engine

    def stage_rows(self, active: list[bool], caps: list[int]) -> None:
        """The rows that take part in the next round, and their depth caps, without waiting for
        the GPU (Staging): a round launched behind a queued prefill is staged while it runs."""
        for staging, values in zip(self.staging, (active, caps)):
            staging.write()[:] = torch.tensor(values)
            staging.upload()

    def rider(self, shape: tuple[int, int]) -> ride.RiderStage:
        """The buffers of riders of this (rows, tokens each) shape (made on first use, before any
        graph reads them)."""
        if shape not in self.riders:
            self.riders[shape] = ride.RiderStage(self._engine, *shape)
        return self.riders[shape]


def eligible(engine: Engine, sessions: list[Session]) -> tuple | None:
    """(mode, budget) when these sessions can share a graphed round, else None."""
    first = sessions[0]
    if any(not s.gen.greedy or s.mode != first.mode for s in sessions):
        return None
    if first.mode == "tree" and any(s.spec.budget != first.spec.budget for s in sessions):
        return None
    if first.mode != "ar":
        block = engine.impl.drafts.block_size
        if any(s._pending is None or s._pending.shape[0] > block for s in sessions):
            return None  # a prompt's features: the eager round appends them
    return first.mode, int(first.spec.budget) if first.mode == "tree" else 0


def graphed_round(engine: Engine, sessions: list[Session], kind: tuple, *, graphs: bool,
                  riders: tuple[list[Session], tuple[int, int]] | None = None, ahead: bool = False
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """The round of these sessions (all eligible with `kind`) through the stage, with the riders'
    next prefill chunks in its forward (ride.pick's riders and shape, fast/ride.py); graphs=False
    runs the same code without capture. Returns each session's committed tokens, and each
    rider's. A round run ahead for these sessions is taken rather than launched; ahead: queue
    the next round too before reading this one (where runs_ahead allows it)."""
    impl, target = engine.impl, engine.target
    pool: KVPool = impl.pool
    stage: RoundStage = impl.round_stage()
    slots = [pool.index_of(s._cache) for s in sessions]
    mode, budget = kind
    t0 = engine.clock()
    pending = stage.ahead
    taken = riders is None and takes_ahead(engine, sessions, kind)
    if pending is not None and not taken:
        drop_ahead(engine)
    shape, counts, riding = 0, [], []
    if taken:
        stage.ahead = None
        stage.ahead_counts["taken"] += 1
        key, lane, saved = pending.key, pending.lane, pending.saved[:2]
        caps = {r: row[2] for r, row in pending.rows.items()}
    else:
        b, q = round_shape(engine, sessions, kind)
        span = _span(engine, max(s._start for s in sessions) + q)
        # What the stage must hold: the active rows, their depth caps and, where a session's
        # features are not already staged (it joined, or ran elsewhere), its bonus and features.
        active = [False] * pool.slots
        caps = [0] * pool.slots
        staged = []
        for s, r in zip(sessions, slots):
            active[r] = True
            caps[r] = s._depth_cap()
            # The stage still holds this session's state when its last round was a graphed one
            # here (same session, same round count) and its pending rows are the staged ones.
            held = stage.holds.get(r) == (id(s), s.verify_ct)
            if mode != "ar" and s._pending.data_ptr() != stage.feats[r].data_ptr():
                held = False
            if not held:
                staged.append((s, r))
        stage.stage_rows(active, caps)
        for s, r in staged:
            stage.bonus[r] = s._bonus
            if mode != "ar":
                rows = int(s._pending.shape[0])
                stage.feats[r, :rows].copy_(s._pending)
                stage.count[r] = rows
        saved = (pool.lengths.clone(), pool.dlengths.clone() if pool.dlengths is not None else None)
        if riders is not None:
            riding, shape = riders
            counts = ride.stage(engine, stage.rider(shape), riding)
        key = (mode, budget, b, span, shape)
        lane = 0 if pending is None else 1 - pending.lane
    following = None
    try:
        packed = None
        if not taken:
            packed = _launch(engine, stage, key, lane, graphs)
        if ahead and not riding:
            following = _run_ahead(engine, stage, sessions, slots, kind, [caps[r] for r in slots], 1 - lane,
                                   graphs)
        if graphs:
            rows_out = unpack_walks(_read(engine, stage, key, lane))
        else:
            rows_out = unpack_walks((pending.packed if taken else packed).tolist())
    except BaseException:
        # Put the lengths back and forget what the stage held. A failure after the replay has
        # run leaves the staged features (a held session's pending rows) as the replay wrote
        # them: that session's next drafts may accept less, but what it commits stays exact,
        # since the walk checks every draft against the target.
        if taken:  # its copies are a turn old: only its own sessions' rows go back
            stage.ahead = pending
            drop_ahead(engine)
        else:
            pool.lengths.copy_(saved[0])
            if saved[1] is not None:
                pool.dlengths.copy_(saved[1])
        for s in riding:  # their host lengths too: a next prefill starts where its rows end
            s._cache.set_length(s._prefilled_rows)
        stage.holds.clear()
        raise
    t1 = engine.clock()
    target._last = target.staged = None
    impl._staged_tree = impl._parents_staged = None
    committed = []
    for s, r in zip(sessions, slots):
        path, new = rows_out[r]
        tau = len(path)
        if mode != "ar":
            s._draft_cache.length += int(s._pending.shape[0])
        s._cache.length = s._start + tau
        s._cache.moved = None
        features = stage.feats[r, :tau] if mode != "ar" else None
        committed.append(s._advance(path, new, features, drafted=mode != "ar"))
        stage.holds[r] = (id(s), s.verify_ct)
    stage.ahead = following
    share = (t1 - t0) / (len(sessions) + len(riding))
    for s in sessions:
        s.timings["verify"] += share
    if not riding:
        return committed, []
    return committed, ride.finish(engine, stage.rider(shape), riding, counts, share)


def _span(engine: Engine, rows: int) -> int:
    """The KV span a round reads for contexts of up to `rows` rows (its queries included)."""
    target = engine.target
    cache_rows = target.new_cache_rows()
    return kv_bucket(cache_rows, rows, target.kv_spans(cache_rows)) if target.bucket_kv else cache_rows


def runs_ahead(engine: Engine) -> bool:
    """Whether rounds may run ahead: FastPath.round_ahead on, and no round's parts timed one by one."""
    return engine.impl.round_ahead and not engine.sync_timings


def takes_ahead(engine: Engine, sessions: list[Session], kind: tuple) -> bool:
    """Whether the round run ahead is these sessions' next round: each of them was in it, at the
    round count it has now, and every other session of it has ended."""
    stage = engine.impl._round_stage
    pending = stage.ahead if stage is not None else None
    if pending is None or pending.key[:2] != kind:
        return False
    for s in sessions:
        row = pending.rows.get(s._cache.slot)
        if row is None or row[0]() is not s or row[1] != s.verify_ct:
            return False
    return len(_still_on(pending)) == len(sessions)


def _still_on(pending: Ahead) -> list[int]:
    """The slots of the round run ahead whose session is still running on them."""
    kept = []
    for r, (ref, _, _) in pending.rows.items():
        s = ref()
        if s is not None and not s.done and s._cache is not None and s._cache.slot == r:
            kept.append(r)
    return kept


def drop_ahead(engine: Engine) -> None:
    """Undo the round run ahead, if any: the sessions of it still on their slots get their
    lengths, the drafter's, and their staged bonus and features back (device-side copies, no
    wait); what else it wrote lies past those lengths, where no query looks."""
    stage = engine.impl._round_stage
    pending = stage.ahead if stage is not None else None
    if pending is None:
        return
    stage.ahead = None
    stage.ahead_counts["dropped"] += 1
    pool: KVPool = engine.impl.pool
    kept = _still_on(pending)
    for r in pending.rows:
        stage.holds.pop(r, None)
    if kept:
        device = pool.lengths.device
        index = torch.tensor(kept, dtype=torch.long)
        if device.type == "cuda":  # pinned, so the copy does not wait for the queued work
            index = index.pin_memory()
        index = index.to(device, non_blocking=True)
        # A held session's pending features are a view of its staged rows: they go back too.
        with torch.inference_mode():  # the stage's buffers are made in it (round_stage's first use)
            for now, before in zip((pool.lengths, pool.dlengths, stage.bonus, stage.count, stage.feats),
                                   pending.saved):
                if before is not None:
                    now.index_copy_(0, index, before.index_select(0, index))


def _run_ahead(engine: Engine, stage: RoundStage, sessions: list[Session], slots: list[int],
               kind: tuple, caps: list[int], lane: int, graphs: bool) -> Ahead | None:
    """Queue the round after the one just launched (whose depth caps were `caps`), for the
    sessions that may still run after it, at the shape that covers them: None where none may, or
    its graph is not captured yet."""
    if not runs_ahead(engine):
        return None
    pool: KVPool = engine.impl.pool
    window = engine.context_window
    # The round in flight commits at least one token a session: those it leaves at a limit stop.
    going = [(s, r, cap) for s, r, cap in zip(sessions, slots, caps)
             if len(s.output_ids) + 2 <= s.gen.max_new_tokens and s._start + 1 < window]
    if not going or (len(going) == 1 and not _lone_round(engine, going[0][0])):
        return None  # (one left steps alone on its slot's graphs, which would drop it)
    mode = kind[0]
    most = max(s._start + cap + 1 for s, _, cap in going)  # the longest context it can leave
    b, q = round_shape(engine, [s for s, _, _ in going], kind)
    key = (*kind, b, _span(engine, most + q), 0)
    if graphs and key not in stage.graphs:
        return None  # captured on its first ordinary round, not here with a round in flight
    active = [False] * pool.slots
    ahead_caps = [0] * pool.slots
    rows = {}
    for s, r, cap in going:
        active[r] = True
        if mode != "ar":
            # As Session._depth_cap after the round in flight, for the window as if that round
            # had accepted all it may (cap + 1 tokens): the next round never writes past the
            # cache, whatever that round accepts (shallower than it could be only near the
            # window). For the tokens wanted, as if it accepted one: a path past them commits
            # only those and is booked at that length (Session._advance), as the serial round's.
            wanted = s.gen.max_new_tokens - len(s.output_ids) - 1
            room = window - s._start - (cap + 1)
            ahead_caps[r] = max(0, min(engine.block_size - 1, wanted - 1, room - 1))
        rows[r] = (weakref.ref(s), s.verify_ct + 1, ahead_caps[r])
    drafting = mode != "ar" and stage.feats is not None
    saved = (pool.lengths.clone(), pool.dlengths.clone() if drafting else None, stage.bonus.clone(),
             stage.count.clone() if drafting else None, stage.feats.clone() if drafting else None)
    stage.stage_rows(active, ahead_caps)
    packed = _launch(engine, stage, key, lane, graphs)
    stage.ahead_counts["launched"] += 1
    return Ahead(key, lane, rows, saved, packed)


def precapture(engine: Engine, budgets: tuple[int, ...], progress=None) -> int:
    """Capture the round graphs a server meets first, before it takes requests: AR, DFlash and
    DDTree at these budgets, every power-of-two batch up to the pool, at the two smallest KV
    spans a round of that kind can have (longer contexts capture on their first round).
    Returns how many it captured."""
    pool = engine.impl.pool
    stage = engine.impl.round_stage()
    kinds = [("ar", 0)]
    if engine.impl.drafts is not None:
        kinds += [("chain", 0)] + [("tree", int(b)) for b in budgets if 0 < b <= engine.max_budget]
    sizes, b = [], 2
    while b < pool.slots:
        sizes.append(b)
        b *= 2
    sizes.append(pool.slots)
    depth = engine.block_size - 1
    rows = engine.target.new_cache_rows()
    buckets = engine.target.kv_spans(rows)
    # With mixed chunks, each key also with riders of each shape it takes (fast/ride.py), written
    # into a free slot by the captures' warm-up runs.
    free = [pool.index_of(pair[0]) for pair in engine.impl._free]
    riding = ride.riders_run(engine) and bool(free)
    made = 0
    for mode, budget in kinds:
        q = _width(engine, mode, budget, depth)
        # graphed_round's span: the bucket of (longest context + q), the context at least 1.
        first = kv_bucket(rows, 1 + q, buckets)
        later = [size for size in buckets if size > first][:1]
        for span in [first, *later]:
            for b in sizes:
                shapes = [0]
                if riding:
                    shapes += ride.shapes(engine, b * q)
                    for shape in shapes[1:]:
                        ride.point_at_free_slot(stage.rider(shape), max(free))
                for shape in shapes:
                    key = (mode, budget, b, span, shape)
                    if key not in stage.graphs:
                        stage.graphs[key] = capture(engine, stage, key)
                        made += 1
        if progress is not None:
            progress(f"captured batched-round graphs for {mode}{'@' + str(budget) if budget else ''} "
                     f"(batches {sizes})")
    return made


def round_shape(engine: Engine, sessions: list[Session], kind: tuple) -> tuple[int, int]:
    """(b, q) of these sessions' graphed round: the power-of-two batch that covers their slots
    (at most the pool), and the query bucket of its kind."""
    pool = engine.impl.pool
    top = max(pool.index_of(s._cache) for s in sessions)
    b = 1
    while b < top + 1:
        b *= 2
    mode, budget = kind
    return min(b, pool.slots), _width(engine, mode, budget, engine.block_size - 1)


def _width(engine: Engine, mode: str, budget: int, depth: int) -> int:
    """The query bucket a round of this kind pads its trees to."""
    vocab = engine.target.vocab_size
    if mode == "ar":
        n = 1
    elif mode == "chain":
        n = 1 + depth
    else:
        total, width = 0, 1
        for _ in range(depth):  # prefixes of length 1..depth, as build_tree_device counts them
            width = min(budget, width * vocab)
            total += width
        n = 1 + min(budget, total)
    return next((size for size in engine.target.buckets if size >= n), n)


def _launch(engine: Engine, stage: RoundStage, key: tuple, lane: int, graphs: bool) -> torch.Tensor | None:
    """Queue the key's round: on CUDA, its graph's replay and the copy of its packed walks into
    the lane's pinned buffer, then the lane's event; without graphs, run it and return them."""
    if not graphs:
        return static_round(engine, stage, *key)
    found = stage.graphs.get(key)
    if found is None:
        found = stage.graphs[key] = capture(engine, stage, key)
    graph, packed = found
    host = stage.host.get((key, lane))
    if host is None:
        host = stage.host[(key, lane)] = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    graph.replay()
    host.copy_(packed, non_blocking=True)
    stage.done[lane].record()
    return None


def _read(engine: Engine, stage: RoundStage, key: tuple, lane: int) -> list[list[int]]:
    """The packed walks of the round _launch queued on this lane: the round's one host sync,
    waited for on an event with the GIL released (a server's HTTP thread streams meanwhile),
    from pinned memory."""
    engine.gpu_busy()
    t0 = time.perf_counter()
    stage.done[lane].synchronize()
    engine.count_wait("gpu", time.perf_counter() - t0)
    return stage.host[(key, lane)].tolist()


def capture(engine: Engine, stage: RoundStage, key: tuple) -> tuple[object, torch.Tensor]:
    """Record static_round for this key with every row inactive (so nothing any session holds
    changes), then restore the rows' activity."""
    saved = stage.active.clone()
    stage.active.zero_()
    if stage.graph_pool is None:
        stage.graph_pool = torch.cuda.graph_pool_handle()
    try:
        return record_graph(lambda: static_round(engine, stage, *key), stage.graph_pool,
                            stage.bonus.device, _WARMUP_RUNS, inference=True)
    finally:
        stage.active.copy_(saved)


def static_round(engine: Engine, stage: RoundStage, mode: str, budget: int, b: int, span: int,
                 riders: tuple[int, int] | int = 0) -> torch.Tensor:
    """One round over slots 0..b-1 with shapes fixed by the arguments, and with riders (their
    (rows, tokens each), fast/ride.py) the staged prefill chunks in its target forward; returns
    the packed walks [b, 1 + 2q] (pack_walks)."""
    target = engine.target
    pool: KVPool = engine.impl.pool
    device = pool.lengths.device
    active = stage.active[:b]
    bonus = stage.bonus[:b]
    if mode == "ar":
        trees = roots_only(bonus)
    else:
        logits = _draft(engine, stage, b, span)
        if mode == "chain":
            trees = chains_device(bonus, logits)
        else:
            trees = build_trees_device(bonus, torch.log_softmax(logits, dim=-1), budget)
        q = _width(engine, mode, budget, logits.shape[1])
        if q > trees.width:
            trees = pad_batch([trees], q)
        # Nodes deeper than a row may go are never accepted (see the module docstring).
        tokens = torch.where(trees.depths > stage.cap[:b, None], -1, trees.tokens)
        trees = TreeBatch(tokens, trees.depths, trees.parents, trees.visible, trees.sizes)
    q = trees.tokens.shape[1]
    lengths = pool.lengths[:b]
    start = lengths.clone()
    plan = batch_plan(target, lengths, trees.visible, span)
    positions = lengths[:, None] + trees.depths
    # A riding chunk's features go to its drafter later, whatever the round's own mode.
    layers = target.feature_layers if mode != "ar" or riders else ()
    tokens, positions = trees.tokens.clamp(min=0).view(-1), positions.reshape(-1)
    if riders:
        tokens, positions, plan = ride.join(target, stage.rider(riders), tokens, positions, plan)
    hidden, feats = target.model(tokens, positions, pool.k, pool.v, plan, layers)
    if riders:
        hidden, feats = ride.split(target, stage.rider(riders), hidden, feats, b * q)
    # In blocks of rows, so b*q rows over a large vocabulary never sit in memory at once.
    posterior = argmax_rows(target, hidden).view(b, q)
    order, count = walk_batch(trees, posterior)
    packed = pack_walks(trees.tokens, posterior, order, count)
    # Commit: every row's accepted K/V rows to start.., its length, its next bonus and features.
    # A path holds the root and at most one node a depth, so only that many rows of the walk
    # order move (17 of 65 a row at budget 64 with a 16-token block).
    moved = q if mode == "ar" else min(q, logits.shape[1] + 1)
    slot_rows = torch.arange(b, device=device)[:, None].expand(b, moved)
    src = start[:, None] + order[:, :moved]
    dst = start[:, None] + torch.arange(moved, device=device)[None]
    for cache in (pool.k, pool.v):
        cache[:, slot_rows, :, dst] = cache[:, slot_rows, :, src]
    lengths.add_(torch.where(active, count, 0))
    last = order.gather(1, (count - 1)[:, None])
    stage.bonus[:b] = torch.where(active, posterior.gather(1, last)[:, 0], bonus)
    if mode != "ar" and feats is not None:
        rows = min(q, stage.feats.shape[1])
        width = feats.shape[-1]
        picked = feats.view(b, q, width).gather(1, order[:, :rows, None].expand(b, rows, width))
        stage.feats[:b, :rows] = torch.where(active[:, None, None], picked, stage.feats[:b, :rows])
        stage.count[:b] = torch.where(active, count, stage.count[:b])
    return packed


def _draft(engine: Engine, stage: RoundStage, b: int, span: int) -> torch.Tensor:
    """Append the staged features of the active rows, then draft every row's block: draft
    logits [b, depth, V] float32 (depth = engine.block_size - 1)."""
    drafts = engine.impl.drafts
    append_context(engine, stage.feats[:b], torch.where(stage.active[:b], stage.count[:b], 0))
    ids = torch.cat((stage.bonus[:b, None],
                     torch.full((b, drafts.block_size - 1), engine.mask_token_id, dtype=torch.long,
                                device=stage.bonus.device)), dim=1)
    hidden = draft_block(engine, ids, span + drafts.block_size)[:, 1:engine.block_size]
    # Rows in one matrix first: on the strided [b, depth, H] view cuBLAS ran a batched GEMM that
    # streamed the whole vocabulary's weights once per row of the batch (2.3 ms of a 9 ms
    # 16-session DFlash round on the 1.7B shape, an H200).
    depth = hidden.shape[1]
    return drafts.lm_head(hidden.reshape(b * depth, -1)).float().view(b, depth, -1)
