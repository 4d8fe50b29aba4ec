"""Prompts of pool sessions prefilled by CUDA graph replays, one graph per padded prompt length.

An eager prefill is one forward of a few hundred small kernels: on an H200 about 16 ms for a
1.7B model whatever the prompt's length, which a server with many short requests pays at every
join, and which stalls every running stream for that long. Here the prompt is padded to a
power of two (PREFILL_MIN up to the context window, at most PREFILL_MAX) and replayed: its
tokens, its length and its slot are device inputs, so one graph per length serves every slot.

The prefill writes K/V rows 0..q-1 of its slot (the padding past the prompt lands past its
length, unseen) and attends causally among its own rows only: a fresh slot has no context.
The logits of the last real row and the features of every row come back, as Session._prefill's
forward gives them; the session then goes on as after any prefill.
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
_WARMUP_RUNS = 2


def prefill_sizes(context_window: int) -> tuple[int, ...]:
    """The padded prompt lengths that get a graph: PREFILL_MIN, 2x, ... up to the window."""
    sizes, size = [], PREFILL_MIN
    while size < min(context_window, PREFILL_MAX):
        sizes.append(size)
        size *= 2
    sizes.append(min(size, PREFILL_MAX, max(context_window, PREFILL_MIN)))
    return tuple(sizes)


class PrefillStage:
    def __init__(self, engine: Engine) -> None:
        target = engine.target
        device = target.device
        self.sizes = prefill_sizes(engine.context_window)
        self.ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        self.count = torch.ones((), dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.steps = torch.arange(self.sizes[-1], device=device)
        self.graphs: dict[int, tuple] = {}
        self.graph_pool = None


def prefill_static(engine: Engine, stage: PrefillStage, q: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompt staged in stage.ids[:count], padded to q, into slot stage.slot: the last real
    row's logits [1, V] float32 and every row's features [q, K*H] (None without feature layers)."""
    target = engine.target
    pool = engine.impl.pool
    steps = stage.steps[:q]
    plan = BatchPlan(b=1, q=q, slots=stage.slot[:, None].expand(1, q), rows=steps[None], read=0,
                     mask=None, kernel=target.attention)
    hidden, feats = target.model(stage.ids[:q], steps, pool.k, pool.v, plan, target.feature_layers)
    last = hidden.index_select(0, (stage.count - 1).reshape(1))
    return target.lm_head(last).float(), feats


def prefill(engine: Engine, sess: Session, *, graphs: bool) -> list[int] | None:
    """Session.step()'s prefill through the stage (None: the prompt is longer than any graph)."""
    impl = engine.impl
    stage = impl.prefill_stage()
    n = len(sess.prompt_ids)
    q = next((size for size in stage.sizes if size >= n), None)
    if q is None:
        return None
    t0 = engine.clock()
    slot = impl.pool.index_of(sess._cache)
    with torch.inference_mode():
        stage.ids[:n].copy_(torch.tensor(sess.prompt_ids, dtype=torch.long, device=stage.ids.device))
        stage.count.fill_(n)
        stage.slot.fill_(slot)
        if graphs:
            found = stage.graphs.get(q)
            if found is None:
                found = stage.graphs[q] = capture(engine, stage, q)
            found[0].replay()
            logits, feats = found[1], found[2]
        else:
            logits, feats = prefill_static(engine, stage, q)
        sess._cache.set_length(n)
        features = None
        if sess.mode != "ar":
            features = (feats[:n].clone() if feats is not None else
                        torch.zeros((n, 0), dtype=engine.target.dtype, device=logits.device))
        committed = sess._prefilled(logits.clone(), features)
    sess.timings["prefill"] += engine.clock() - t0
    return committed


def capture(engine: Engine, stage: PrefillStage, q: int) -> tuple:
    """Record prefill_static at length q. Its warm-up runs write rows 0..q-1 of slot stage.slot,
    so the caller points that at a free slot, or at the fresh slot of the session about to
    prefill (whose prompt overwrites them next)."""
    if stage.graph_pool is None:
        stage.graph_pool = torch.cuda.graph_pool_handle()
    graph, (logits, feats) = record_graph(lambda: prefill_static(engine, stage, q), stage.graph_pool,
                                          stage.ids.device, _WARMUP_RUNS, inference=True)
    return graph, logits, feats


def precapture(engine: Engine, progress=None) -> None:
    """Capture every prefill length before a server takes requests, on a free slot."""
    impl = engine.impl
    stage = impl.prefill_stage()
    free = [impl.pool.index_of(pair[0]) for pair in impl._free]
    if not free:
        return
    stage.slot.fill_(max(free))
    stage.count.fill_(1)
    for q in stage.sizes:
        if q not in stage.graphs:
            stage.graphs[q] = capture(engine, stage, q)
    if progress is not None:
        progress(f"captured prefill graphs for prompts up to {stage.sizes[-1]} tokens")
