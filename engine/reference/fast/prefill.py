"""Prompts of pool sessions prefilled by CUDA graph replays: the new prompts of a turn together,
one graph per (rows, padded prompt length).

An eager prefill is one forward of a few hundred small kernels: on an H200 about 16 ms for a
1.7B model whatever the prompt's length, which a server with many short requests pays at every
join, and which stalls every running stream for that long. A graph replay of one short prompt
costs about 2.6 ms there, and the requests that join in one turn paid one each, in a row (58 ms
to the first token at concurrency 16). So the prompts of one padded length (the power of two
above it, PREFILL_MIN up to the context window, at most PREFILL_MAX) share a forward, in as many
rows as there are of them where a graph has that many (powers of two and the pool's slots, at
most PREFILL_BATCH_TOKENS tokens a forward). No prompt is padded further than it would be alone:
a prefill of a few hundred tokens is compute-bound, and padding four prompts to the longest's
length left the 1.7B grid's TTFT at concurrency 4 where it was (16 ms). Tokens, lengths and slots
are device inputs, so one graph per shape serves every slot.

Each prompt writes K/V rows 0..q-1 of its own slot (the padding past the prompt lands past its
length, unseen) and attends causally among its own rows only: a fresh slot has no context. The
logits of each prompt's last real row and the features of every row come back, as
Session._prefill's forward gives them; each session then goes on as after any prefill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.fast.model import BatchPlan
from ddtree.engine.reference.fast.graphs import record_graph

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine

PREFILL_MIN = 16
PREFILL_MAX = 4096
# Padded tokens one batched prefill takes at most (a lone prompt may take its whole bucket):
# bounds the activations and keeps the graphs few.
PREFILL_BATCH_TOKENS = 4096
_WARMUP_RUNS = 2


def prefill_sizes(context_window: int) -> tuple[int, ...]:
    """The padded prompt lengths that get a graph: PREFILL_MIN, 2x, ... up to the window."""
    sizes, size = [], PREFILL_MIN
    while size < min(context_window, PREFILL_MAX):
        sizes.append(size)
        size *= 2
    sizes.append(min(size, PREFILL_MAX, max(context_window, PREFILL_MIN)))
    return tuple(sizes)


def batch_rows(slots: int) -> tuple[int, ...]:
    """The row counts a batched prefill pads to: powers of two below the pool's slots, then the
    slots (as the graphed rounds' batch sizes)."""
    rows, b = [], 1
    while b < slots:
        rows.append(b)
        b *= 2
    return (*rows, slots)


def shapes(sizes: tuple[int, ...], rows: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every (rows, length) a prefill graph has (plan_groups' groups): one prompt at every
    length, more rows while they fit PREFILL_BATCH_TOKENS."""
    return [(b, q) for b in rows for q in sizes if b == 1 or b * q <= PREFILL_BATCH_TOKENS]


def plan_groups(lengths: list[int], sizes: tuple[int, ...], rows: tuple[int, ...]) -> list[list[int]]:
    """Indices of these prompt lengths (each at most sizes[-1]) grouped for batched prefills.
    Only prompts of one padded length share a forward, in as many rows as there are prompts
    (the most `rows` and PREFILL_BATCH_TOKENS allow, then the rest): a prefill of a few hundred
    tokens is compute-bound on a GPU, so a group must not pad a prompt further than its own
    prefill would. Shortest first."""
    by_size: dict[int, list[int]] = {}
    for j in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        by_size.setdefault(next(s for s in sizes if s >= lengths[j]), []).append(j)
    groups = []
    for q, members in by_size.items():
        while members:
            b = max(r for r in rows if r <= len(members) and (r == 1 or r * q <= PREFILL_BATCH_TOKENS))
            groups.append(members[:b])
            members = members[b:]
    return groups


class PrefillStage:
    def __init__(self, engine: Engine) -> None:
        target = engine.target
        device = target.device
        pool = engine.impl.pool
        self.sizes = prefill_sizes(engine.context_window)
        self.rows = batch_rows(pool.slots)
        self.ids = torch.zeros(max(self.sizes[-1], PREFILL_BATCH_TOKENS), dtype=torch.long, device=device)
        self.counts = torch.ones(self.rows[-1], dtype=torch.long, device=device)
        self.slots = torch.zeros(self.rows[-1], dtype=torch.long, device=device)
        self.steps = torch.arange(self.sizes[-1], device=device)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.graph_pool = None
        # Every graph writes its outputs here, so the graphs' own outputs are temporaries that
        # the next capture reuses: dozens of shapes would otherwise each keep their features.
        self.logits = torch.zeros((self.rows[-1], target.vocab_size), dtype=torch.float32, device=device)
        width = len(target.feature_layers) * target.hidden_size
        self.feats = torch.zeros((self.ids.shape[0], width), dtype=target.dtype, device=device) if width else None


def prefill_static(engine: Engine, stage: PrefillStage, b: int, q: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The b prompts staged in stage.ids[:b*q] (row j's at j*q, counts[j] long, padded to q) into
    slots stage.slots[:b]: each row's last real logits [b, V] float32 and every row's features
    [b*q, K*H] (None without feature layers)."""
    target = engine.target
    pool = engine.impl.pool
    steps = stage.steps[:q]
    plan = BatchPlan(b=b, q=q, slots=stage.slots[:b, None].expand(b, q), rows=steps[None].expand(b, q), read=0,
                     mask=None, kernel=target.attention)
    hidden, feats = target.model(stage.ids[:b * q], steps.repeat(b), pool.k, pool.v, plan, target.feature_layers)
    last = torch.arange(b, device=steps.device) * q + stage.counts[:b] - 1
    return target.lm_head(hidden.index_select(0, last)).float(), feats


def prefill_many(engine: Engine, sessions: list[Session], *, graphs: bool) -> list[list[int] | None]:
    """Session.step()'s prefill of each of these new pool sessions, in as few batched forwards as
    plan_groups allows; None for a prompt longer than any graph (the caller steps it alone).
    If a group raises, the groups before it have committed their first tokens (in each session's
    output_ids, as a prefill that stepped alone would have) and its sessions and the later ones
    are still new."""
    stage = engine.impl.prefill_stage()
    out: list[list[int] | None] = [None] * len(sessions)
    fit = [j for j, s in enumerate(sessions) if len(s.prompt_ids) <= stage.sizes[-1]]
    for group in plan_groups([len(sessions[j].prompt_ids) for j in fit], stage.sizes, stage.rows):
        members = [fit[k] for k in group]
        for j, tokens in zip(members, _prefill_group(engine, stage, [sessions[j] for j in members], graphs)):
            out[j] = tokens
    return out


def _prefill_group(engine: Engine, stage: PrefillStage, sessions: list[Session], graphs: bool) -> list[list[int]]:
    t0 = engine.clock()
    pool = engine.impl.pool
    lengths = [len(s.prompt_ids) for s in sessions]
    b, q = len(sessions), next(size for size in stage.sizes if size >= max(lengths))
    ids = [0] * (b * q)
    for j, s in enumerate(sessions):
        ids[j * q:j * q + lengths[j]] = s.prompt_ids
    device = stage.ids.device
    committed = []
    with torch.inference_mode():
        stage.ids[:b * q].copy_(torch.tensor(ids, dtype=torch.long, device=device))
        stage.counts[:b].copy_(torch.tensor(lengths, dtype=torch.long, device=device))
        stage.slots[:b].copy_(torch.tensor([pool.index_of(s._cache) for s in sessions], dtype=torch.long, device=device))
        if graphs:
            found = stage.graphs.get((b, q))
            if found is None:
                found = stage.graphs[(b, q)] = capture(engine, stage, b, q)
            found[0].replay()
            logits, feats = found[1], found[2]
        else:
            logits, feats = prefill_static(engine, stage, b, q)
        # The greedy rows' first tokens in one argmax and one sync, not one of each a session
        # (64 joiners: 64 launches and host waits in a row, with the GPU idle between them).
        greedy = [j for j, s in enumerate(sessions) if s.gen.greedy]
        picks = logits[:b].argmax(dim=-1) if len(greedy) > 1 else None
        engine.gpu_busy()  # the sessions' first tokens below wait for the forward
        every = picks.tolist() if picks is not None else []
        firsts = {j: every[j] for j in greedy} if every else {}
        # Nothing in a session has changed before this point: a forward that raises leaves them new.
        for j, s in enumerate(sessions):
            n = lengths[j]
            s._cache.set_length(n)
            features = None
            if s.mode != "ar":
                features = (feats[j * q:j * q + n].clone() if feats is not None else
                            torch.zeros((n, 0), dtype=engine.target.dtype, device=logits.device))
            try:
                if j in firsts:
                    committed.append(s._prefilled(None, features, firsts[j]))
                else:
                    committed.append(s._prefilled(logits[j:j + 1].clone(), features))
            except BaseException:
                s._cache.set_length(0)  # still new: a later step prefills it from row 0
                raise
    share = (engine.clock() - t0) / len(sessions)
    for s in sessions:
        s.timings["prefill"] += share
    return committed


def capture(engine: Engine, stage: PrefillStage, b: int, q: int) -> tuple:
    """Record prefill_static at (b, q). Its warm-up runs write rows 0..q-1 of the staged slots,
    so the caller points them at a free slot, or at the fresh slots of the sessions about to
    prefill (whose prompts overwrite them next)."""
    if stage.graph_pool is None:
        stage.graph_pool = torch.cuda.graph_pool_handle()
    def run():
        logits, feats = prefill_static(engine, stage, b, q)
        stage.logits[:b].copy_(logits)
        if feats is None:
            return stage.logits[:b], None
        stage.feats[:b * q].copy_(feats)
        return stage.logits[:b], stage.feats[:b * q]

    graph, (logits, feats) = record_graph(run, stage.graph_pool, stage.ids.device, _WARMUP_RUNS, inference=True)
    return graph, logits, feats


def precapture(engine: Engine, progress=None) -> None:
    """Capture every prefill shape before a server takes requests, on a free slot."""
    impl = engine.impl
    stage = impl.prefill_stage()
    free = [impl.pool.index_of(pair[0]) for pair in impl._free]
    if not free:
        return
    stage.slots.fill_(max(free))  # every row writes that slot: the warm-ups' rows are garbage
    stage.counts.fill_(1)
    made = 0
    for key in shapes(stage.sizes, stage.rows):
        if key not in stage.graphs:
            stage.graphs[key] = capture(engine, stage, *key)
            made += 1
    if progress is not None:
        progress(f"captured {made} prefill graphs: prompts up to {stage.sizes[-1]} tokens, "
                 f"up to {stage.rows[-1]} at once within {PREFILL_BATCH_TOKENS} padded tokens")
