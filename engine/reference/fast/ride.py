"""A new request's prefill chunk riding in a graphed round: its prompt tokens join the round's
target forward, so a join no longer stalls the running streams (issue 15, chunked prefill).

Why: a joining request prefilled in a forward of its own between two rounds, and every running
stream waited for it. On the 1.7B shape on an H200 a lone ~250-token prompt costs about what a
round at concurrency 16 costs, so the server's ITL p99 there was 3x its p50. Any forward of its
own, however short, streams the weights once more (a one-token step alone takes 1.6 ms there). Riding, the chunk's tokens go
through every GEMM with the round's rows, which are weight-bound at a few dozen tokens; only
attention runs apart (model.MixedPlan), the chunk's over its own pool slot, named on the device
(the kernel's slot index), so one graph per round key serves any joiner.

With engine.mixed_chunk (the server's --enable-mixed-chunk) and a prefill chunk C (its
--chunked-prefill-size), a turn whose running sessions share a graphed round takes the next
W = min(C, RIDE_MAX) prompt tokens (padded to W; all of a shorter prompt) of one new session into
that round, of the one whose prompt is part in already, else of the first; the turn's other new
sessions wait. So while requests run, prefill happens inside their rounds only, one chunk a round:
a later first token for the joiners, no stall for the running streams. First come, first served:
a long prompt holds later joiners back until it is in (as SGLang runs one chunked request at a
time), and if the first cannot ride (its chunk would not fit its slot) the turn prefills as
without riders. A turn with no graphed round (fewer than two running sessions, or a mix of kinds)
prefills as before.

Measured on an H200 (bench/RESULTS.md): a first version that let the new sessions of one turn
prefill together in a forward of their own, and rode only a lone joiner, left the 1.7B grid's ITL
p99 at concurrency 16 where it was (6.9 against 7.2 ms), since that grid's joins come in groups.

What the graph does with the rider: it writes the chunk's K/V rows [start, start + W) of its slot,
and leaves the last real row's logits and every row's features in the stage. The host then sets
the slot's length and, after the last chunk, commits the first token as any prefill does. The
round's rows do not know the rider: if its slot is among slots 0..b-1, that row is inactive and
writes its padding at the slot's length, so the host sets that length past the chunk first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.fast.batch import batch_plan
from ddtree.engine.reference.fast.model import BatchPlan, MixedPlan

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine


class RiderStage:
    """A chunk's device inputs and outputs (the round graphs bake in their addresses)."""

    def __init__(self, engine: Engine, chunk: int) -> None:
        target = engine.target
        device = target.device
        self.chunk = chunk
        self.ids = torch.zeros(chunk, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.count = torch.ones(1, dtype=torch.long, device=device)
        self.tree = torch.ones((chunk, chunk), dtype=torch.bool, device=device).tril()[None]
        self.logits = torch.zeros((1, target.vocab_size), dtype=torch.float32, device=device)
        width = len(target.feature_layers) * target.hidden_size
        self.feats = torch.zeros((chunk, width), dtype=target.dtype, device=device) if width else None


# Prompt tokens a chunk riding in a round takes at most (the graphs pad every rider to its width):
# the round's GEMMs stay near their weight-bound cost with this many more rows.
RIDE_MAX = 128


def width(engine: Engine) -> int:
    """The tokens a rider takes: the prefill chunk, at most RIDE_MAX."""
    return min(engine.prefill_chunk, RIDE_MAX)


def riders_run(engine: Engine) -> bool:
    """Whether a chunk can ride here: mixed chunks are on with a prefill chunk, and attention
    reads a slot in place (the triton kernel; on a CPU the other kernels copy the slot, which
    tests may afford)."""
    target = engine.target
    return (engine.mixed_chunk and engine.prefill_chunk > 0
            and (target.attention == "triton" or target.device.type == "cpu"))


def pick(engine: Engine, rider: RiderStage, new: list[Session], q: int) -> Session | None:
    """The first of these new sessions, if its next chunk fits its slot beside a round q tokens a
    row wide (the inactive row of its slot writes past the chunk); else None, and the turn
    prefills as without riders, so a session that cannot ride is never passed over for ever."""
    pool = engine.impl.pool
    rows = engine.target.new_cache_rows()
    s = new[0]
    if pool.index_of(s._cache) is not None and s._prefilled_rows + rider.chunk + q <= rows:
        return s
    return None


def stage(engine: Engine, rider: RiderStage, s: Session) -> int:
    """Put s's next chunk in the stage and its slot's length past the chunk; its real count."""
    start = s._prefilled_rows
    ids = s.prompt_ids[start:start + rider.chunk]
    padded = ids + [0] * (rider.chunk - len(ids))
    device = rider.ids.device
    rider.ids.copy_(torch.tensor(padded, dtype=torch.long, device=device))
    rider.slot.fill_(engine.impl.pool.index_of(s._cache))
    rider.start.fill_(start)
    rider.count.fill_(len(ids))
    s._cache.set_length(start + rider.chunk)
    return len(ids)


def point_at_free_slot(rider: RiderStage, slot: int) -> None:
    """Before a capture with no rider: its warm-up runs write a chunk into this (free) slot."""
    rider.slot.fill_(slot)
    rider.start.zero_()
    rider.count.fill_(1)


def join(target, rider: RiderStage, tokens: torch.Tensor, positions: torch.Tensor, plan: BatchPlan):
    """The round's flat tokens, positions and plan with the chunk's appended."""
    chunk = rider.chunk
    steps = torch.arange(chunk, device=tokens.device)
    alone = batch_plan(target, rider.start, rider.tree, target.new_cache_rows())
    alone = dataclasses.replace(alone, slots=rider.slot[:, None].expand(1, chunk), index=rider.slot)
    mixed = MixedPlan(parts=(plan, alone), slots=torch.cat((plan.slots.reshape(-1), alone.slots.reshape(-1))),
                      rows=torch.cat((plan.rows.reshape(-1), alone.rows.reshape(-1))))
    return torch.cat((tokens, rider.ids)), torch.cat((positions, rider.start + steps)), mixed


def split(target, rider: RiderStage, hidden: torch.Tensor, feats: torch.Tensor | None, n: int):
    """Keep the chunk's last real logits and its features in the stage; the round's own rows."""
    last = rider.count - 1 + n
    rider.logits.copy_(target.lm_head(hidden.index_select(0, last)).float())
    if feats is not None and rider.feats is not None:
        rider.feats.copy_(feats[n:])
    return hidden[:n], None if feats is None else feats[:n]


def finish(engine: Engine, rider: RiderStage, s: Session, count: int, seconds: float) -> list[int]:
    """After the round: the chunk is in s's cache; the first token once the prompt is all in."""
    end = s._prefilled_rows + count
    s._cache.set_length(end)
    s._prefilled_rows = end
    s.timings["prefill"] += seconds
    features = None
    if s.mode != "ar":
        features = (rider.feats[:count].clone() if rider.feats is not None else
                    torch.zeros((count, 0), dtype=engine.target.dtype, device=rider.ids.device))
    if end < len(s.prompt_ids):
        if features is not None:
            s._prefill_features.append(features)
        return []
    if features is not None and s._prefill_features:
        features = torch.cat([*s._prefill_features, features], dim=0)
    s._prefill_features = []
    return s._prefilled(rider.logits.clone(), features)
