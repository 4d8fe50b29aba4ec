"""Prompts of pool sessions prefilled together: the new prompts of a turn packed into one
forward, as CUDA graph replays, one graph per padded token count.

An eager prefill is one forward of a few hundred small kernels: on an H200 about 16 ms for a
1.7B model whatever the prompt's length, which a server with many short requests pays at every
join, and which stalls every running stream for that long. A graph replay of one short prompt
costs about 2.6 ms there. When many requests join in one turn (a wave of 16 at concurrency 16),
their prefill is compute-bound: padding each prompt to a power of two and running one forward per
padded length gave 1.39x the prompts' tokens on the grid's dataset and several forwards, about
30 ms a wave on an H100, some 15% of the cell. So the prompts go end to end into one row of
tokens (up to PREFILL_BATCH_TOKENS, then another forward), padded once, to the next of a few
dozen sizes (pack_sizes); every GEMM takes them all, and attention keeps each token within its
own prompt (model.BatchPlan.segments: flash's varlen kernel on CUDA in half precision, a loop
over the prompts elsewhere). Tokens, positions, slots and the prompts' bounds are device inputs,
so one graph per size serves every mix of prompts and slots.

Each prompt writes K/V rows 0..n-1 of its own slot and attends causally among them: a fresh slot
has no context. The padding is a prompt of its own, whose rows all land in the last row of the
first prompt's slot: past its length, unseen, and finite (the matmul kernel multiplies unseen
rows by zero). The logits of each prompt's last row and the features of every row come back, as
Session._prefill's forward gives them; each session then goes on as after any prefill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from ddtree.engine.reference.fast.model import BatchPlan, packed_attention_works
from ddtree.engine.reference.fast.graphs import Staging, record_graph

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine

PREFILL_MIN = 16
# Tokens one packed prefill takes at most: bounds the activations and keeps the graphs few. A
# prompt longer than this prefills on its own (Session.step).
PREFILL_BATCH_TOKENS = 4096
_WARMUP_RUNS = 2
# The turn's round launched before the first tokens are read (prefill_many's `then`); False
# reads them first, as before, for bench/bench_burst.py's A/B.
ROUND_BEFORE_FIRSTS = True


def pack_sizes(limit: int) -> tuple[int, ...]:
    """The token counts a packed prefill pads to, up to limit (at least PREFILL_MIN): past 32 each
    at most 1.5x the one below it, and past 256 at most 1.25x (steps of 64 up to 1024, of 256
    beyond), in 32 graphs."""
    sizes = [PREFILL_MIN, 32, 48, 64, 96, 128, 192, *range(256, 1025, 64), *range(1280, PREFILL_BATCH_TOKENS + 1, 256)]
    top = max(PREFILL_MIN, min(limit, PREFILL_BATCH_TOKENS))
    kept = [size for size in sizes if size < top]
    return (*kept, next((size for size in sizes if size >= top), PREFILL_BATCH_TOKENS))


def plan_packs(lengths: list[int], limit: int) -> list[list[int]]:
    """Indices of these prompt lengths grouped into packs of at most `limit` tokens, in order
    (first come, first in a pack); a prompt longer than limit is in none (it prefills alone)."""
    packs: list[list[int]] = []
    used = limit
    for j, n in enumerate(lengths):
        if n > limit:
            continue
        if used + n > limit:
            packs.append([])
            used = 0
        packs[-1].append(j)
        used += n
    return packs


class PrefillStage:
    def __init__(self, engine: Engine) -> None:
        target = engine.target
        device = target.device
        pool = engine.impl.pool
        cfg = target.cfg
        self.sizes = pack_sizes(pool.slots * engine.context_window)
        self.limit = self.sizes[-1]
        self.prompts = pool.slots
        self.scratch_row = pool.k.shape[3] - 1  # the padding's row (see the module docstring)
        # One kernel for every prompt where flash's varlen form runs; else a loop over the
        # prompts, which reads their lengths on the host, so no graph can replay it.
        self.packed_kernel = packed_attention_works(device, target.dtype, cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        n = self.limit
        # Every input in one buffer, so a turn's staging is one host-to-device copy, and one
        # that does not wait for the GPU (a pack staged behind another's forward).
        self.inputs = torch.zeros(4 * n + 2 * self.prompts + 2, dtype=torch.long, device=device)
        self.staging = Staging(self.inputs)
        self.ids, self.positions, self.rows, self.slots = self.inputs[:4 * n].view(4, n)
        self.last = self.inputs[4 * n:4 * n + self.prompts]
        self.bounds = self.inputs[4 * n + self.prompts:]  # int64 here; the kernel's int32 in the graph
        # The greedy first tokens come back here, each pack in its sessions' places.
        self.firsts_host = torch.zeros(self.prompts, dtype=torch.long, pin_memory=device.type == "cuda")
        self.graphs: dict[int, tuple] = {}
        self.graph_pool = None
        # Every graph writes its outputs here, so the graphs' own outputs are temporaries that
        # the next capture reuses: dozens of sizes would otherwise each keep their features.
        self.logits = torch.zeros((self.prompts, target.vocab_size), dtype=torch.float32, device=device)
        width = len(target.feature_layers) * target.hidden_size
        self.feats = torch.zeros((n, width), dtype=target.dtype, device=device) if width else None

    def stage(self, prompts: list[list[int]], slots: list[int]) -> tuple[int, tuple[int, ...]]:
        """Write these prompts, bound for these pool slots, into the inputs: (the padded token
        count, every prompt's length and then the padding's, in the order packed)."""
        total = sum(len(p) for p in prompts)
        size = next(s for s in self.sizes if s >= total)
        pad = size - total
        ids, positions, rows, where, bounds, last = [], [], [], [], [0], []
        for prompt, slot in zip(prompts, slots):
            ids += prompt
            positions += range(len(prompt))
            where += [slot] * len(prompt)
            bounds.append(bounds[-1] + len(prompt))
            last.append(bounds[-1] - 1)
        # Every padding token writes the one scratch row: which write lands is unspecified, and
        # nobody reads it.
        rows = positions + [self.scratch_row] * pad
        ids += [0] * pad
        positions += [0] * pad
        where += [slots[0]] * pad
        bounds += [size] * (self.prompts + 2 - len(bounds))
        last += [0] * (self.prompts - len(last))
        n, host = self.limit, self.staging.write()
        for k, values in enumerate((ids, positions, rows, where)):
            host[k * n:k * n + size] = torch.tensor(values, dtype=torch.long)
        host[4 * n:] = torch.tensor(last + bounds, dtype=torch.long)
        self.staging.upload()
        return size, (*(len(p) for p in prompts), pad)


def prefill_static(engine: Engine, stage: PrefillStage, size: int,
                   lengths: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompts staged in stage's first `size` tokens (PrefillStage.stage), into their slots:
    every prompt's last logits [stage.prompts, V] float32 (rows past the prompts: garbage) and
    every token's features [size, K*H] (None without feature layers). lengths: the prompts' and
    the padding's token counts, for the kernel that loops over them (None with the varlen one)."""
    target = engine.target
    pool = engine.impl.pool
    plan = BatchPlan(b=1, q=size, slots=stage.slots[None, :size], rows=stage.rows[None, :size], read=0,
                     mask=None, kernel=target.attention, segments=stage.bounds.to(torch.int32),
                     segment_lengths=None if stage.packed_kernel else lengths)
    hidden, feats = target.model(stage.ids[:size], stage.positions[:size], pool.k, pool.v, plan,
                                 target.feature_layers)
    return target.lm_head(hidden.index_select(0, stage.last)).float(), feats


def prefill_many(engine: Engine, sessions: list[Session], *, graphs: bool,
                 then: Callable[[], None] | None = None) -> list[list[int] | None]:
    """Session.step()'s prefill of each of these new pool sessions, packed into as few forwards
    as PREFILL_BATCH_TOKENS allows; None for a prompt longer than that (the caller steps it
    alone).

    `then` runs once every pack is launched and before their first tokens are read: a turn's
    running round goes there, so its launch overlaps the prefill's forward and the host's
    bookkeeping of the new sessions waits for the round's sync, not the GPU for the host. The
    sessions' lengths are set before `then` runs, so the round's rows for their slots (inactive
    in it) write past their prompts. If anything raises before a pack's first tokens are read,
    its sessions are still new (length 0); a pack read before that keeps its first tokens."""
    stage = engine.impl.prefill_stage()
    out: list[list[int] | None] = [None] * len(sessions)
    launched: list[_Launched] = []
    try:
        for pack in plan_packs([len(s.prompt_ids) for s in sessions], stage.limit):
            launched.append(_launch_pack(engine, stage, pack, [sessions[j] for j in pack], graphs))
            for s, n in zip(launched[-1].sessions, launched[-1].counts):
                s._cache.set_length(n)
        if then is not None and ROUND_BEFORE_FIRSTS:
            then()
        while launched:
            for j, tokens in zip(launched[0].pack, _finish_pack(engine, launched[0])):
                out[j] = tokens
            launched.pop(0)
        if then is not None and not ROUND_BEFORE_FIRSTS:
            then()
    except BaseException:
        for run in launched:
            for s in run.sessions:
                if s._bonus is None:
                    s._cache.set_length(0)  # still new: a later step prefills it from row 0
        raise
    return out


class _Launched(NamedTuple):
    """A pack whose forward is queued: what _finish_pack needs to read it."""
    pack: list[int]
    sessions: list[Session]
    counts: tuple[int, ...]  # their prompts' token counts
    firsts: torch.Tensor | None  # the greedy rows' argmax (pinned host memory on a GPU)
    ready: torch.cuda.Event | None
    greedy: list[int]
    logits: list[torch.Tensor | None]  # the other rows' last logits, copied out of the stage
    features: list[torch.Tensor | None]
    seconds: float


def _launch_pack(engine: Engine, stage: PrefillStage, pack: list[int], sessions: list[Session],
                 graphs: bool) -> _Launched:
    """Queue one pack's forward and copy out what each session needs (the stage's outputs are
    the next pack's), without waiting for the GPU."""
    t0 = engine.clock()
    pool = engine.impl.pool
    with torch.inference_mode():
        size, counts = stage.stage([s.prompt_ids for s in sessions], [pool.index_of(s._cache) for s in sessions])
        if graphs and stage.packed_kernel:
            found = stage.graphs.get(size)
            if found is None:
                found = stage.graphs[size] = capture(engine, stage, size)
            found[0].replay()
            logits, feats = found[1], found[2]
        else:
            logits, feats = prefill_static(engine, stage, size, counts)
        # The greedy rows' first tokens in one argmax and one read, not one of each a session
        # (64 joiners: 64 launches and host waits in a row, with the GPU idle between them).
        greedy = [j for j, s in enumerate(sessions) if s.gen.greedy]
        firsts = ready = None
        if len(greedy) > 1:
            firsts = logits[:len(sessions)].argmax(dim=-1)
            if firsts.is_cuda:
                host = stage.firsts_host[pack[0]:pack[0] + len(sessions)]
                host.copy_(firsts, non_blocking=True)
                firsts, ready = host, torch.cuda.Event()
                ready.record()
        else:
            greedy = []
        rows, features, at = [], [], 0
        for j, s in enumerate(sessions):
            n = counts[j]
            rows.append(None if j in greedy else logits[j:j + 1].clone())
            features.append(None if s.mode == "ar" else
                            feats[at:at + n].clone() if feats is not None else
                            torch.zeros((n, 0), dtype=engine.target.dtype, device=logits.device))
            at += n
    # Nothing in a session has changed here: a forward that raises leaves them new.
    return _Launched(pack, sessions, counts[:len(sessions)], firsts, ready, greedy, rows, features,
                     engine.clock() - t0)


def _finish_pack(engine: Engine, run: _Launched) -> list[list[int]]:
    """Read a launched pack's first tokens (its one wait for the GPU) and commit them."""
    t0 = engine.clock()
    if run.ready is not None and not run.ready.query():
        engine.gpu_busy()
        run.ready.synchronize()
    every = run.firsts.tolist() if run.firsts is not None else []
    committed = []
    for j, s in enumerate(run.sessions):
        if j in run.greedy:
            committed.append(s._prefilled(None, run.features[j], every[j]))
        else:
            committed.append(s._prefilled(run.logits[j], run.features[j]))
    share = (run.seconds + engine.clock() - t0) / len(run.sessions)
    for s in run.sessions:
        s.timings["prefill"] += share
    return committed


def capture(engine: Engine, stage: PrefillStage, size: int) -> tuple:
    """Record prefill_static at this size (varlen kernel only). Its warm-up runs write the staged
    rows, so the caller points them at a free slot, or at the fresh slots of the sessions about
    to prefill (whose prompts overwrite them next)."""
    if stage.graph_pool is None:
        stage.graph_pool = torch.cuda.graph_pool_handle()

    def run():
        logits, feats = prefill_static(engine, stage, size)
        stage.logits.copy_(logits)
        if feats is None:
            return stage.logits, None
        stage.feats[:size].copy_(feats)
        return stage.logits, stage.feats[:size]

    graph, (logits, feats) = record_graph(run, stage.graph_pool, stage.ids.device, _WARMUP_RUNS, inference=True)
    return graph, logits, feats


def precapture(engine: Engine, progress=None) -> None:
    """Capture every pack size before a server takes requests, on a free slot."""
    impl = engine.impl
    stage = impl.prefill_stage()
    free = [impl.pool.index_of(pair[0]) for pair in impl._free]
    if not free or not stage.packed_kernel:
        return
    made = 0
    for size in stage.sizes:
        if size not in stage.graphs:
            # One prompt of `size` tokens, every row the scratch row of a free slot: garbage there.
            stage.stage([[0] * size], [max(free)])
            stage.rows.fill_(stage.scratch_row)
            stage.graphs[size] = capture(engine, stage, size)
            made += 1
    if progress is not None:
        progress(f"captured {made} prefill graphs: prompts packed up to {stage.limit} tokens a forward")
