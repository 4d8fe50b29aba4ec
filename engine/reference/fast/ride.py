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
prompt tokens of new sessions into that round, first come first served (those whose prompt is
part in already first). The riders form R rows of W tokens each (padded), R x W at most the
round's allowance: its own rows (b x q) rounded down to a power of two, between 2 x RIDE_MIN and
RIDE_MAX, so a ridden round costs at most about two plain ones. The shapes a round takes: one
rider of RIDE_MIN tokens; one of the whole allowance, for a long prompt; and, when several new
sessions wait, allowance / RIDE_ROW rows of RIDE_ROW tokens (each W also at most C), where each
rider takes the rows the rest of its prompt needs, up to C tokens, while rows are left. With the
server's --max-prefill-tokens (engine.max_prefill_tokens) every shape stays within it: a lone
rider narrows to it, several become as many rows as it holds (or none), and
below RIDE_MIN one rider as wide as the cap is all; the joiners that prefill on their own
instead are capped by fast/batch.step_many. Rows
without a rider write into a rider's slot past its chunks, rows no one reads (not into its
chunk's rows: two GEMM rows of the same tokens need not round alike, and which write landed would
be a race). The turn's other new sessions wait. So while requests run, prefill
happens inside their rounds only: a later first token for the joiners, no stall for the
running streams. If the first cannot ride (its chunk would not fit its slot) the turn prefills
as without riders. A turn with no graphed round (fewer than two running sessions, or a mix of
kinds) prefills as before. So does a burst: several prompts whose riding would take more than
BURST_ROUNDS times the turns that prefilling alone takes, as a cohort of short prompts does
when it finds few streams running (small rounds take four rows). Prefilled together, all of
them in that turn (or, under the cap, in as few turns as it allows), they cost the running
streams one gap (or a few); riding, the last of them would wait for many rounds. SGLang leans
the same way with mixed chunks: a step prefills waiting prompts up to its
--chunked-prefill-size tokens, the running decodes mixed in (here a burst takes every waiting
prompt the cap lets through at once, in forwards of at most 4096 padded tokens,
fast/prefill.py). A burst's prompts that are part in already cannot go in that forward (it
starts every prompt at row 0): they ride in the burst's round, so a burst turn has riders too.

Measured on an H200 (bench/RESULTS.md), 1.7B shape, concurrency 16: a first version that let the
new sessions of one turn prefill together in a forward of their own, and rode only a lone
joiner, left the ITL p99 where it was (6.9 against 7.2 ms), since that grid's joins come in
groups. One rider of 128 tokens a round met the ITL target for AR (p99 4.4 against p50 2.5 ms),
but DDTree-16's TTFT p99 rose from 65 to 180 ms: a wave's joiners rode one after another through
its 7 ms rounds. A single wider rider (one round a prompt) left that p99 at 182 ms. Hence
several riders a round. Four a round still left it at 164 ms: a cell's first wave reaches the
engine a few ms apart through HTTP, so its last joiners rode two a round through the first
sessions' small rounds. Hence the burst rule. With it, riders lowered the ITL p99 in 7 of 9
cells at concurrency 4-64, at 1-11% of throughput and a higher TTFT p99 in most of them: a trade,
so the flag stays off by default.

What the graph does with the riders: each row writes its chunk's K/V rows [start, start + W) of
its slot, and leaves its last real row's logits and every row's features in the stage. The
host then sets each slot's length and, after the last chunk, commits the first token as any
prefill does. The round's rows do not know the riders: if a rider's slot is among slots
0..b-1, that row is inactive and writes its padding at the slot's length, so the host sets that
length past the chunk first.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.fast.batch import batch_plan
from ddtree.engine.reference.fast.model import BatchPlan, MixedPlan
from ddtree.engine.reference.params import within_prefill_cap

if TYPE_CHECKING:
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.engine import Engine


class RiderStage:
    """The riders' device inputs and outputs, `rows` chunks of `chunk` tokens (the round graphs
    bake in their addresses)."""

    def __init__(self, engine: Engine, rows: int, chunk: int) -> None:
        target = engine.target
        device = target.device
        self.rows, self.chunk = rows, chunk
        self.ids = torch.zeros(rows * chunk, dtype=torch.long, device=device)
        self.slot = torch.zeros(rows, dtype=torch.long, device=device)
        self.start = torch.zeros(rows, dtype=torch.long, device=device)
        self.count = torch.ones(rows, dtype=torch.long, device=device)
        self.tree = torch.ones((chunk, chunk), dtype=torch.bool, device=device).tril().repeat(rows, 1, 1)
        self.logits = torch.zeros((rows, target.vocab_size), dtype=torch.float32, device=device)
        width = len(target.feature_layers) * target.hidden_size
        self.feats = torch.zeros((rows * chunk, width), dtype=target.dtype, device=device) if width else None


# A rider row's tokens (below this, the round's GEMMs stay near their weight-bound cost whatever
# the round), and the most rider tokens a round takes.
RIDE_MIN, RIDE_MAX = 128, 512


# The settings an A/B run may override (bench_server.py --engine-loops +rideN, +burstN): the
# part's name -> (the variable, its most; its least is 1).
OVERRIDES = {"ride": ("DDTREE_RIDE_ROW", 2 * RIDE_MIN), "burst": ("DDTREE_BURST_ROUNDS", 64)}


def _setting(part: str, default: int) -> int:
    """This setting's override where it is an integer in range, else the default."""
    name, most = OVERRIDES[part]
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and 1 <= int(value) <= most else default


# The width of each row when several new sessions ride: narrower than RIDE_MIN, so that a round's
# allowance carries more of the short prompts a chat workload sends (the grid's builtin:code
# prompts are 26-226 tokens, median 45, with the chat template) and fewer joins turn into
# bursts; a longer prompt takes more rows. At most the narrowest allowance.
RIDE_ROW = _setting("ride", 64)
# Riding may take at most this many times the turns that prefilling alone would take to give
# every waiting prompt its first token; past that the wait is a burst (pick()).
BURST_ROUNDS = _setting("burst", 2)


def shapes(engine: Engine, rows: int) -> list[tuple[int, int]]:
    """The (riders, tokens each) shapes a round of `rows` rows (b x q) takes (module docstring)."""
    allowance = RIDE_MIN * 2
    while allowance * 2 <= min(rows, RIDE_MAX):
        allowance *= 2
    base, row = min(RIDE_MIN, engine.prefill_chunk), min(RIDE_ROW, engine.prefill_chunk)
    out = [(1, base), (1, min(allowance, engine.prefill_chunk)), (allowance // RIDE_ROW, row)]
    cap = engine.max_prefill_tokens  # a turn's prompt tokens, riders' included
    if cap > 0:  # a lone rider narrows to the cap; several become as many as it holds
        out = [(1, min(w, cap)) if n == 1 else (min(n, cap // w), w) for n, w in out]
    return sorted({(n, w) for n, w in out if n >= 1})


def riders_run(engine: Engine) -> bool:
    """Whether a chunk can ride here: mixed chunks are on with a prefill chunk, and attention
    reads a slot in place (the triton kernel; on a CPU the other kernels copy the slot, which
    tests may afford)."""
    target = engine.target
    return (engine.mixed_chunk and engine.prefill_chunk > 0
            and (target.attention == "triton" or target.device.type == "cpu"))


def pick(engine: Engine, new: list[Session], rows: int, q: int, *,
         burst_check: bool = True) -> tuple[list[Session], tuple[int, int]] | None:
    """The riders of a round of `rows` rows, q tokens a row wide, from these new sessions in
    order, and their shape: with several waiting, as many as a multi-row shape holds, each taking
    the rows the rest of its prompt needs while rows are left (row_counts), else the first alone
    at the narrowest width that holds the rest of its prompt (else the widest).
    Each rider's chunks must fit its slot beside the round (the inactive row of its slot writes
    past them), and with spare rows one rider's slot must hold a chunk more past its own (spare());
    if the first does not fit, None, and the turn prefills as without riders, so a session that
    cannot ride is never passed over for ever. A burst gets None too (burst()), unless
    burst_check is off: a burst turn's prompts already part in ride that way (fast/batch.py)."""
    pool = engine.impl.pool
    cache_rows = engine.target.new_cache_rows()
    options = shapes(engine, rows)
    if burst_check and burst(engine, new, options):
        return None

    def fits(s: Session, width: int) -> bool:
        return pool.index_of(s._cache) is not None and s._prefilled_rows + width + q <= cache_rows

    several = [shape for shape in options if shape[0] > 1]
    if len(new) > 1 and several:
        count, width = several[-1]
        riders: list[Session] = []
        for s, k in zip(new, row_counts(engine, new, count, width)):  # a rider's rows follow from those before it
            if k == 0 or not fits(s, k * width):
                break
            riders.append(s)
        if len(riders) > 1 and (sum(row_counts(engine, riders, count, width)) == count
                                or spare(engine, riders, width, count) is not None):
            return riders, (count, width)
    lone = sorted(width for count, width in options if count == 1)
    rest = len(new[0].prompt_ids) - new[0]._prefilled_rows
    width = next((w for w in lone if w >= rest), lone[-1])
    return ([new[0]], (1, width)) if fits(new[0], width) else None


def row_counts(engine: Engine, riders: list[Session], count: int, width: int) -> list[int]:
    """The rows of a (count, width) shape each rider takes, in order: as many as the rest of its
    prompt needs, while rows are left, and no more tokens than the prefill chunk. A rider's rows
    are consecutive chunks of its prompt; the later ones attend to the earlier ones' keys and
    values, which every layer writes for all the round's tokens before its attention."""
    out, left, most = [], count, max(1, engine.prefill_chunk // width)
    for s in riders:
        need = max(1, -(-(len(s.prompt_ids) - s._prefilled_rows) // width))
        out.append(min(need, most, left))
        left -= out[-1]
    return out


def burst(engine: Engine, new: list[Session], options: list[tuple[int, int]]) -> bool:
    """Whether these new sessions are a burst: several, and riding would take more than
    BURST_ROUNDS times the turns that prefilling alone takes to give the last of them its first
    token. Alone, each prompt takes a chunk a turn, as many at once as max_prefill_tokens lets
    (turns_alone); riding, the round's widest shape bounds the tokens a round, and the lone
    width a session's (a rider of several rows takes no more). A lone prompt always rides,
    however long: a long prompt is what riding spares the running streams from."""
    rests = [max(0, len(s.prompt_ids) - s._prefilled_rows) for s in new]
    if len(rests) < 2:
        return False
    lone = max(width for count, width in options if count == 1)
    riding = max(-(-sum(rests) // max(count * width for count, width in options)),
                 *(-(-rest // lone) for rest in rests))
    # Counting stops where the answer is known: at riding / BURST_ROUNDS turns alone, no burst.
    alone = turns_alone(rests, engine.prefill_chunk, engine.max_prefill_tokens, most=-(-riding // BURST_ROUNDS))
    return riding > BURST_ROUNDS * alone


def turns_alone(rests: list[int], chunk: int, cap: int, most: int | None = None) -> int:
    """Turns until prompts with these many tokens left are all prefilled on their own: a chunk
    of each a turn (chunk <= 0: the whole prompt), those within the cap
    (params.within_prefill_cap) going each turn; counted up to `most` at most."""
    if chunk <= 0:
        chunk = max(rests, default=1)
    if cap <= 0 or sum(min(rest, chunk) for rest in rests) <= cap:  # the cap never binds
        turns = max((-(-rest // chunk) for rest in rests), default=0)
        return turns if most is None else min(turns, most)
    rests, turns = list(rests), 0
    while any(rests) and (most is None or turns < most):
        live = [i for i, rest in enumerate(rests) if rest]
        go = within_prefill_cap([min(rests[i], chunk) for i in live], cap)
        for i, ok in zip(live, go):
            if ok:
                rests[i] -= min(rests[i], chunk)
        turns += 1
    return turns


def spare(engine: Engine, riders: list[Session], width: int, count: int) -> Session | None:
    """The rider whose slot takes the writes of the stage's spare rows: the first with room for
    one chunk more past its own."""
    rows = engine.target.new_cache_rows()
    return next((s for s, k in zip(riders, row_counts(engine, riders, count, width))
                 if s._prefilled_rows + (k + 1) * width <= rows), None)


def stage(engine: Engine, rider: RiderStage, riders: list[Session]) -> list[int]:
    """Put the riders' next chunks in the stage (row_counts), the spare rows past a rider's
    chunks (spare()), and each slot's length past its chunks; the real rows' token counts."""
    w, pool = rider.chunk, engine.impl.pool
    ids, slots, starts, counts = [], [], [], []
    taken = row_counts(engine, riders, rider.rows, w)
    for s, k in zip(riders, taken):
        for j in range(k):
            start = s._prefilled_rows + j * w
            chunk = s.prompt_ids[start:start + w]
            ids += chunk + [0] * (w - len(chunk))
            slots.append(pool.index_of(s._cache))
            starts.append(start)
            counts.append(len(chunk))
    real = len(counts)
    if real < rider.rows:
        host = spare(engine, riders, w, rider.rows)
        k = taken[riders.index(host)]
        for _ in range(rider.rows - real):
            ids += [0] * w
            slots.append(pool.index_of(host._cache))
            starts.append(host._prefilled_rows + k * w)
            counts.append(1)
    device = rider.ids.device
    rider.ids.copy_(torch.tensor(ids, dtype=torch.long, device=device))
    rider.slot.copy_(torch.tensor(slots, dtype=torch.long, device=device))
    rider.start.copy_(torch.tensor(starts, dtype=torch.long, device=device))
    rider.count.copy_(torch.tensor(counts, dtype=torch.long, device=device))
    for s, k in zip(riders, taken):
        s._cache.set_length(s._prefilled_rows + k * w)
    return counts[:real]


def point_at_free_slot(rider: RiderStage, slot: int) -> None:
    """Before a capture with no riders: its warm-up runs write every row's chunk into this (free)
    slot."""
    rider.slot.fill_(slot)
    rider.start.zero_()
    rider.count.fill_(1)


def join(target, rider: RiderStage, tokens: torch.Tensor, positions: torch.Tensor, plan: BatchPlan):
    """The round's flat tokens, positions and plan with the riders' appended."""
    rows, chunk = rider.rows, rider.chunk
    steps = torch.arange(chunk, device=tokens.device)
    alone = batch_plan(target, rider.start, rider.tree, target.new_cache_rows())
    alone = dataclasses.replace(alone, slots=rider.slot[:, None].expand(rows, chunk), index=rider.slot)
    mixed = MixedPlan(parts=(plan, alone), slots=torch.cat((plan.slots.reshape(-1), alone.slots.reshape(-1))),
                      rows=torch.cat((plan.rows.reshape(-1), alone.rows.reshape(-1))))
    at = (rider.start[:, None] + steps).reshape(-1)
    return torch.cat((tokens, rider.ids)), torch.cat((positions, at)), mixed


def split(target, rider: RiderStage, hidden: torch.Tensor, feats: torch.Tensor | None, n: int):
    """Keep each rider row's last real logits and its features in the stage; the round's own rows."""
    last = n + torch.arange(rider.rows, device=hidden.device) * rider.chunk + rider.count - 1
    rider.logits.copy_(target.lm_head(hidden.index_select(0, last)).float())
    if feats is not None and rider.feats is not None:
        rider.feats.copy_(feats[n:])
    return hidden[:n], None if feats is None else feats[:n]


def finish(engine: Engine, rider: RiderStage, riders: list[Session], counts: list[int],
           seconds: float) -> list[list[int]]:
    """After the round: each rider's chunks are in its cache; its first token once its prompt is
    all in. counts: the real rows' token counts (stage()). Returns each rider's committed tokens.
    Every rider's rows and features are in place before any first token is committed, so one
    that raises leaves no later rider behind."""
    done = []
    first = 0
    for i, (s, k) in enumerate(zip(riders, row_counts(engine, riders, rider.rows, rider.chunk))):
        last = first + k - 1
        count = sum(counts[first:first + k])
        s._prefilled_rows += count
        s._cache.set_length(s._prefilled_rows)
        s.timings["prefill"] += seconds
        features = None
        if s.mode != "ar":  # its rows are consecutive and all but the last full
            at = first * rider.chunk
            features = (rider.feats[at:at + count].clone() if rider.feats is not None else
                        torch.zeros((count, 0), dtype=engine.target.dtype, device=rider.ids.device))
        first += k
        if s._prefilled_rows < len(s.prompt_ids):
            if features is not None:
                s._prefill_features.append(features)
            continue
        if features is not None and s._prefill_features:
            features = torch.cat([*s._prefill_features, features], dim=0)
        s._prefill_features = []
        done.append((i, features, rider.logits[last:last + 1].clone()))
    out: list[list[int]] = [[] for _ in riders]
    for i, features, logits in done:
        out[i] = riders[i]._prefilled(logits, features)
    return out
