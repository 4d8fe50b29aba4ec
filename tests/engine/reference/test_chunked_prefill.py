"""Chunked prefill (issue 15: long prompts prefill in chunks so running streams keep their ITL).
CPU, float32. A prompt longer than `engine.prefill_chunk` goes into the cache one chunk a step;
the tokens must be exactly those of a whole prefill, on both backends, alone and in batched
rounds beside running sessions; and in the scheduler the running stream gets a token in every
turn of the long prompt's prefill."""

from __future__ import annotations

import queue
import random
import types

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.scheduler import Scheduler

from .conftest import make_drafter, make_target

SPECS = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 4), SpecParams("ddtree", 16)]
CHUNK = 4


@pytest.fixture(scope="module")
def pair():
    model = make_target(0)
    return model, make_drafter(model, block_size=8, seed=1)


def engines(pair, backend: str, **kw) -> tuple[Engine, Engine]:
    """(whole-prefill engine, chunked engine) on the same weights."""
    whole = Engine(*pair, backend=backend, max_budget=16, **kw)
    chunked = Engine(*pair, backend=backend, max_budget=16, **kw)
    chunked.prefill_chunk = CHUNK
    return whole, chunked


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(rng.randrange(1, 15))] for _ in range(count)]


def _collect_done(active: list, out: dict) -> None:
    """Move each finished (job index, session) from `active` to out[index], closing it."""
    for item in list(active):
        if item[1].done:
            out[item[0]] = item[1].output_ids
            item[1].close()
            active.remove(item)


def serve(engine: Engine, jobs: list[list[int]], gen: GenParams, spec: SpecParams, running: int = 4) -> list:
    """Every job through step_many, up to `running` sessions at once, each new one joining as
    another finishes; the sessions, in job order (closed)."""
    active, started, nxt = [], [], 0
    while active or nxt < len(jobs):
        while nxt < len(jobs) and len(active) < running:
            active.append(engine.start(jobs[nxt], gen, spec))
            started.append(active[-1])
            nxt += 1
        engine.step_many(active)
        for s in [s for s in active if s.done]:
            s.close()
            active.remove(s)
    return started


@pytest.mark.parametrize("backend", ["transformers", "fast"])
def test_chunked_prefill_decodes_the_whole_prefills_tokens(pair, backend):
    whole, chunked = engines(pair, backend)
    gen = GenParams(max_new_tokens=12, ignore_eos=True)
    for prompt in prompts(0, 6) + [list(range(1, 14))]:
        for spec in SPECS:
            want = whole.generate(prompt, gen, spec).output_ids
            assert chunked.generate(prompt, gen, spec).output_ids == want, (prompt, spec)


@pytest.mark.parametrize("backend", ["transformers", "fast"])
def test_a_long_prompt_takes_a_step_per_chunk_before_its_first_token(pair, backend):
    _, chunked = engines(pair, backend)
    sess = chunked.start(list(range(1, 11)), GenParams(max_new_tokens=4), SpecParams("ddtree", 4))
    assert sess.chunked_prefill
    assert sess.next_prefill_tokens() == CHUNK  # what a scheduler's prefill cap counts
    assert [sess.step(), sess.step()] == [[], []] and sess.output_ids == []
    assert sess.next_prefill_tokens() == 2
    first = sess.step()  # rows 9 and 10, then the first token
    assert len(first) == 1 and sess.output_ids == first and not sess.chunked_prefill
    assert sess.next_prefill_tokens() == 0
    short = chunked.start([1, 2, 3], GenParams(max_new_tokens=4), SpecParams("ar"))
    assert not short.chunked_prefill and short.next_prefill_tokens() == 3 and len(short.step()) == 1


@pytest.mark.parametrize("backend,pooled", [("transformers", False), ("fast", False), ("fast", True)])
def test_chunked_prefills_in_batched_rounds_match_serial(pair, backend, pooled):
    whole, chunked = engines(pair, backend, **({"pool_slots": 4} if pooled else {}))
    if pooled:
        chunked.impl.batch_static = True  # the graphed round's code, without graphs, on a CPU
    gen = GenParams(max_new_tokens=10, ignore_eos=True)
    jobs = [(p, SPECS[i % len(SPECS)]) for i, p in enumerate(prompts(1, 8) + [list(range(2, 16))] * 2)]
    want = [whole.generate(p, gen, s).output_ids for p, s in jobs]
    # Sessions join two a round, so long prompts prefill chunk by chunk beside running rounds.
    active, out, nxt = [], {}, 0
    while active or nxt < len(jobs):
        for _ in range(2):
            if nxt < len(jobs) and len(active) < 4:
                active.append((nxt, chunked.start(jobs[nxt][0], gen, jobs[nxt][1])))
                nxt += 1
        chunked.step_many([s for _, s in active])
        _collect_done(active, out)
    assert [out[j] for j in range(len(jobs))] == want
    if pooled:
        assert chunked.pool_usage()["free_slots"] == 4


def test_a_running_stream_gets_a_token_every_turn_of_a_long_prefill(pair):
    engine = Engine(*pair, backend="transformers", max_budget=16)
    engine.prefill_chunk = CHUNK
    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True)
    sched.start()
    try:
        running: queue.Queue = queue.Queue()
        long: queue.Queue = queue.Queue()
        sched.submit([1, 2, 3], GenParams(max_new_tokens=60, ignore_eos=True), SpecParams("ar"), running.put)
        first = running.get(timeout=120)  # the stream is running before the long prompt arrives
        assert first.new_ids
        prompt = list(range(1, 4 * CHUNK + 2))  # 5 chunks
        ticket = sched.submit(prompt, GenParams(max_new_tokens=2, ignore_eos=True), SpecParams("ar"), long.put)
        head = long.get(timeout=120)
        assert head.new_ids
        updates = [first]
        while not updates[-1].done:
            updates.append(running.get(timeout=120))
        # Admitted in the turn after it was submitted, it prefills one chunk a turn and gets its
        # first token with the fifth; the stream got a token in each of those turns.
        chunks = -(-len(prompt) // CHUNK)
        assert head.turn == ticket.submitted_turn + chunks
        turns = {u.turn for u in updates if u.new_ids}
        assert set(range(ticket.submitted_turn + 1, head.turn + 1)) <= turns
    finally:
        sched.stop(timeout=30)


def test_long_chunks_after_earlier_rows_decode_the_whole_prefills_tokens(pair):
    """Chunks of more than LONG_BLOCK rows after earlier rows attend with SDPA on the fast
    backend (the matmul kernel would hold every float32 score); same tokens as a whole prefill."""
    from ddtree.engine.reference.fast.target import LONG_BLOCK

    whole, chunked = engines(pair, "fast")
    chunked.prefill_chunk = LONG_BLOCK + 22
    prompt = [random.Random(3).randrange(64) for _ in range(3 * chunked.prefill_chunk - 5)]
    gen = GenParams(max_new_tokens=8, ignore_eos=True)
    for spec in (SpecParams("ar"), SpecParams("ddtree", 16)):
        assert chunked.generate(prompt, gen, spec).output_ids == whole.generate(prompt, gen, spec).output_ids


def test_closing_a_session_mid_prefill_lets_its_chunks_go(pair):
    _, chunked = engines(pair, "fast")
    sess = chunked.start(list(range(1, 11)), GenParams(max_new_tokens=4), SpecParams("ddtree", 4))
    sess.step()
    assert sess._prefill_features  # the first chunk's features, kept for the first draft
    sess.close()
    assert sess._prefill_features == [] and sess.done and sess.finish_reason == "abort"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.algorithm}{s.budget}")
def test_chunks_riding_in_graphed_rounds_decode_as_serial(pair, spec, monkeypatch):
    """With a chunk size and a graphed round running, new sessions' prompts go into the cache one
    chunk a turn inside the round's target forward (fast/ride.py), several a round, the turn's
    other new sessions waiting; every output is still the serial one, whatever the riders'
    algorithms."""
    from ddtree.engine.reference.fast import ride

    monkeypatch.setattr(ride, "RIDE_ROW", 128)  # two rider rows a round at most, so joiners wait
    whole, chunked = engines(pair, "fast", pool_slots=8)
    chunked.impl.batch_static = True  # the graphed round's code, without graphs, on a CPU
    chunked.mixed_chunk = True
    rides = []
    real_finish = ride.finish
    monkeypatch.setattr(ride, "finish", lambda *a: rides.append(a[3]) or real_finish(*a))
    gen = GenParams(max_new_tokens=9, ignore_eos=True)
    rng = random.Random(7)
    # The running sessions share one kind; joiners may be of any kind.
    jobs = [([rng.randrange(64) for _ in range(rng.randrange(1, 20))], SPECS[k % 4] if k % 5 == 4 else spec)
            for k in range(24)]
    want = [whole.generate(p, gen, s).output_ids for p, s in jobs]
    active, out, nxt, waited = [], {}, 0, 0
    while active or nxt < len(jobs):
        while nxt < len(jobs) and len(active) < 8:
            active.append((nxt, chunked.start(jobs[nxt][0], gen, jobs[nxt][1])))
            nxt += 1
        new = [s for _, s in active if s._bonus is None]
        before, ridden = [s._cache.length for s in new], len(rides)
        chunked.step_many([s for _, s in active])
        if len(rides) > ridden:  # a turn with riders prefills nothing else
            assert chunked.turn_note.startswith("riders ")  # for the scheduler's turn trace
            assert sum(s._cache.length - b for s, b in zip(new, before)) == sum(rides[-1])
            assert max(rides[-1]) <= CHUNK
            waited += len(new) > len(rides[-1])
        _collect_done(active, out)
    assert [out[j] for j in range(len(jobs))] == want
    assert waited and max(len(r) for r in rides) > 1
    assert chunked.pool_usage()["free_slots"] == 8


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "not-ahead"])
def test_with_mixed_chunks_a_long_prompt_rides_in_the_running_round_a_chunk_a_turn(pair, monkeypatch, ahead):
    """The scheduler steps new and running requests in one call (--enable-mixed-chunk): the long
    prompt's chunks ride in the running streams' round, one a turn, with no turn of its own.
    Where the streams' round has run ahead (fast/batch_graph.py), it cannot take a rider: the
    prompt waits that one turn, and rides from the next."""
    from ddtree.engine.reference.fast import ride

    _, engine = engines(pair, "fast", pool_slots=4)
    engine.impl.batch_static = True
    engine.impl.round_ahead = ahead
    engine.mixed_chunk = True
    rides = []
    real_finish = ride.finish
    monkeypatch.setattr(ride, "finish", lambda *a: rides.append(a[3]) or real_finish(*a))
    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True)
    sched.start()
    try:
        streams = [queue.Queue(), queue.Queue()]
        for q in streams:
            sched.submit([1, 2, 3], GenParams(max_new_tokens=60, ignore_eos=True), SpecParams("ar"), q.put)
        firsts = [q.get(timeout=120) for q in streams]
        assert all(u.new_ids for u in firsts)
        long: queue.Queue = queue.Queue()
        prompt = list(range(1, 4 * CHUNK + 2))  # 5 chunks
        ticket = sched.submit(prompt, GenParams(max_new_tokens=2, ignore_eos=True), SpecParams("ar"), long.put)
        head = long.get(timeout=120)
        assert head.new_ids and head.turn == ticket.submitted_turn + 5 + ahead
        assert rides == [[CHUNK]] * 4 + [[1]]
        updates = [firsts[0]]
        while not updates[-1].done:
            updates.append(streams[0].get(timeout=120))
        turns = {u.turn for u in updates if u.new_ids}
        assert set(range(ticket.submitted_turn + 1, head.turn + 1)) <= turns
    finally:
        sched.stop(timeout=30)


def test_a_failing_ridden_round_leaves_the_riders_where_they_were(pair, monkeypatch):
    """A round that raises with chunks riding changes neither the running sessions nor the
    riders: each cache length is its prefilled rows again, and they decode as serial afterwards."""
    from ddtree.engine.reference.fast import batch_graph

    whole, engine = engines(pair, "fast", pool_slots=4)
    engine.impl.batch_static = True
    engine.mixed_chunk = True
    gen = GenParams(max_new_tokens=8, ignore_eos=True)
    running = [engine.start([1, 2, 3], gen, SpecParams("ar")) for _ in range(2)]
    engine.step_many(running)  # their prefills: no round to ride yet
    prompts = [list(range(5, 6 + 2 * CHUNK)), list(range(9, 12 + 2 * CHUNK))]
    riders = [engine.start(p, gen, SpecParams("ar")) for p in prompts]
    engine.step_many(running + riders)  # their first chunks ride, two rows
    assert all(r._prefilled_rows == CHUNK and r._cache.length == CHUNK for r in riders)
    before = [list(s.output_ids) for s in running]
    lengths = engine.impl.pool.lengths.clone()

    def broken(*args, **kwargs):
        raise RuntimeError("round failed")
    monkeypatch.setattr(batch_graph, "static_round", broken)
    with pytest.raises(RuntimeError):
        engine.step_many(running + riders)
    assert [list(s.output_ids) for s in running] == before and torch.equal(engine.impl.pool.lengths, lengths)
    assert all(r._prefilled_rows == CHUNK and r._cache.length == CHUNK for r in riders)
    monkeypatch.undo()
    while not all(r.done for r in riders):
        engine.step_many([s for s in running + riders if not s.done])
    assert [r.output_ids for r in riders] == [whole.generate(p, gen, SpecParams("ar")).output_ids for p in prompts]


def test_a_burst_rides_the_prompts_part_in_and_prefills_the_others_beside_the_round(pair, monkeypatch):
    """A burst's packed prefill starts every prompt at row 0. A prompt whose first chunk rode
    already takes its next chunk in the burst's round, rather than a Session.step() of its own
    after the round (outside any graph: 22-30 ms on an H100). The burst's joiners prefill in the
    same turn, and everyone decodes as serial."""
    whole, engine = engines(pair, "fast", pool_slots=18)
    engine.impl.batch_static = True
    engine.mixed_chunk = True
    burst_beside_a_prompt_part_in(whole, engine, monkeypatch)


def burst_beside_a_prompt_part_in(whole: Engine, engine: Engine, monkeypatch) -> None:
    """The burst test's body, for an engine of 18 pool slots with mixed chunks of CHUNK tokens
    (test_cuda_pool.py runs it graphed)."""
    from ddtree.engine.reference.decode import Session
    from ddtree.engine.reference.fast import ride

    gen = GenParams(max_new_tokens=8, ignore_eos=True)
    # 15 joiners of CHUNK tokens: riding, 67 tokens at most 16 a round take 5 rounds; alone, two
    # turns (the part-in prompt's two chunks left); 5 > BURST_ROUNDS x 2.
    rng = random.Random(3)
    joining = [[rng.randrange(64) for _ in range(CHUNK)] for _ in range(15)]
    prompts = [[1, 2, 3], [4, 5, 6, 7], list(range(5, 8 + 2 * CHUNK)), *joining]
    running = [engine.start(p, gen, SpecParams("ar")) for p in prompts[:2]]
    engine.step_many(running)  # their prefills: no round to ride yet
    part = engine.start(prompts[2], gen, SpecParams("ar"))
    engine.step_many(running + [part])
    assert engine.turn_note == "riders 1x4" and part._prefilled_rows == CHUNK and part._bonus is None
    assert ride.BURST_ROUNDS == 2
    joiners = [engine.start(p, gen, SpecParams("ar")) for p in prompts[3:]]
    alone = []
    real_prefill = Session._prefill
    monkeypatch.setattr(Session, "_prefill", lambda self: alone.append(self) or real_prefill(self))
    engine.step_many(running + [part] + joiners)
    assert engine.turn_note == "burst, riders 1x4" and alone == []
    assert part._prefilled_rows == 2 * CHUNK and part._bonus is None
    assert all(len(j.output_ids) == 1 for j in joiners)
    assert set(engine.turn_parts) == {"decide", "launch", "round", "firsts", "after"}
    sessions = running + [part] + joiners
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    assert alone == []
    for s, p in zip(sessions, prompts):
        assert s.output_ids == whole.generate(p, gen, SpecParams("ar")).output_ids
        s.close()
    assert engine.pool_usage()["free_slots"] == engine.impl.pool.slots


def test_riders_shapes_and_picks(pair):
    """A round's rider shapes grow with its rows (fast/ride.py); several new sessions ride
    together as rows of RIDE_ROW tokens, a lone one at the narrowest width that holds its rest."""
    from ddtree.engine.reference.fast import ride

    _, engine = engines(pair, "fast", pool_slots=8)
    engine.prefill_chunk = 2048
    assert ride.RIDE_ROW == 64
    assert ride.shapes(engine, 16) == [(1, 128), (1, 256), (4, 64)]  # AR at concurrency 16
    assert ride.shapes(engine, 16 * 32) == ride.shapes(engine, 10**6) == [(1, 128), (1, 512), (8, 64)]
    engine.prefill_chunk = 200
    assert ride.shapes(engine, 10**6) == [(1, 128), (1, 200), (8, 64)]
    engine.prefill_chunk = CHUNK
    assert ride.shapes(engine, 10**6) == [(1, CHUNK), (8, CHUNK)]
    engine.prefill_chunk = 2048
    gen = GenParams(max_new_tokens=2)
    long = engine.start(list(range(1, 60)) * 5, gen, SpecParams("ar"))
    short = engine.start(list(range(1, 51)), gen, SpecParams("ar"))
    others = [engine.start([1, 2, 3], gen, SpecParams("ar")) for _ in range(4)]
    assert ride.pick(engine, [long], 512, 32) == ([long], (1, 512))
    assert ride.pick(engine, [short], 512, 32) == ([short], (1, 128))
    assert ride.pick(engine, [long], 16, 1) == ([long], (1, 256))
    # long's rest takes every row of a multi-row shape, so it rides alone, first come.
    assert ride.pick(engine, [long, short], 16, 1) == ([long], (1, 256))
    assert ride.pick(engine, [short, *others], 16, 1) == ([short, *others[:3]], (4, 64))
    assert ride.pick(engine, [short, *others], 512, 32) == ([short, *others], (8, 64))
    # A burst prefills in a forward of its own: riding would take more than BURST_ROUNDS times
    # the turns that prefilling alone takes (one turn here, a chunk of 2048; long's 295 tokens
    # ride in two rounds of 256 wide, not with 230 more; in a wider round they do).
    more = engine.start(list(range(1, 47)) * 5, gen, SpecParams("ar"))
    assert ride.BURST_ROUNDS == 2 and ride.pick(engine, [long, more], 16, 1) is None
    assert ride.pick(engine, [long, more], 512, 32) == ([long, more], (8, 64))  # 5 rows and 3
    engine.prefill_chunk = 128  # alone: three turns; riding, by burst()'s count, three rounds
    assert ride.pick(engine, [long, more], 16, 1) == ([long, more], (4, 64))  # two rows each: the chunk
    engine.prefill_chunk = 2048
    # A lone prompt is never a burst, however many rounds it rides through (burst() reads only
    # the prompts' lengths, so these stand-ins may be longer than this engine's window).
    huge, small = (types.SimpleNamespace(prompt_ids=[1] * n, _prefilled_rows=0) for n in (1800, 50))
    assert not ride.burst(engine, [huge], ride.shapes(engine, 16))
    assert ride.burst(engine, [huge, small], ride.shapes(engine, 16))
    # The chunk and the round's q rows must fit the slot; one that does not stops the pick
    # there (first come, first served), and a first that does not makes the turn prefill.
    rows = engine.target.new_cache_rows()
    others[1]._prefilled_rows = rows - 64 - 31
    assert ride.pick(engine, [short, others[0], others[1], others[2]], 512, 32) == ([short, others[0]], (8, 64))
    assert ride.pick(engine, [others[1], short], 512, 32) is None
    others[1]._prefilled_rows = rows - 128 - 32
    assert ride.pick(engine, [others[1]], 512, 32) == ([others[1]], (1, 128))
    # Spare rows write past a rider's chunk, in its own slot: one rider needs room for two chunks.
    assert ride.pick(engine, [others[1], others[2]], 512, 32) == ([others[1], others[2]], (8, 64))
    assert ride.spare(engine, [others[1], others[2]], 128, 4) is others[2]
    assert ride.spare(engine, [others[1], others[2]], 64, 8) is others[1]
    others[1]._prefilled_rows = others[2]._prefilled_rows = rows - 127
    assert ride.spare(engine, [others[1], others[2]], 64, 8) is None
    assert ride.pick(engine, [others[1], others[2]], 16, 1) is None  # and the first alone does not fit
    others[1]._prefilled_rows = others[2]._prefilled_rows = 0
    stage = ride.RiderStage(engine, 4, 128)
    assert ride.stage(engine, stage, [short, others[0]]) == [50, 3]
    slot = engine.impl.pool.index_of(short._cache)
    assert stage.start.tolist() == [0, 0, 128, 128] and stage.slot.tolist()[2:] == [slot, slot]
    assert short._cache.length == others[0]._cache.length == 128  # past the chunks, until finish
    # A rider takes the rows the rest of its prompt needs while rows are left, its chunks in a row.
    short._cache.set_length(0)
    assert ride.row_counts(engine, [long, short], 4, 128) == [3, 1]
    assert ride.row_counts(engine, [long, short], 2, 128) == [2, 0]
    assert ride.stage(engine, stage, [long, short]) == [128, 128, 39, 50]
    assert stage.start.tolist() == [0, 128, 256, 0] and long._cache.length == 384
    assert stage.slot.tolist()[:3] == [engine.impl.pool.index_of(long._cache)] * 3
    for sess in (long, short, *others):
        sess.close()


@pytest.mark.parametrize("spec", [SpecParams("ar"), SpecParams("ddtree", 16)], ids=lambda s: s.algorithm)
def test_riders_of_every_shape_decode_as_serial(pair, spec, monkeypatch):
    """The rider widths scaled down (RIDE_MIN and RIDE_ROW 2, RIDE_MAX 8), so that rounds of these tiny
    batches take lone riders, and several riders a round, some of several rows. Every output is
    still the serial one. (Rows to spare past a rider of several rows: the test after this.)"""
    from ddtree.engine.reference.fast import ride

    monkeypatch.setattr(ride, "RIDE_MIN", 2)
    monkeypatch.setattr(ride, "RIDE_MAX", 8)
    monkeypatch.setattr(ride, "RIDE_ROW", 2)
    whole, chunked = engines(pair, "fast", pool_slots=4)
    chunked.prefill_chunk = 8
    chunked.impl.batch_static = True
    chunked.mixed_chunk = True
    seen = set()
    real_stage = ride.stage
    monkeypatch.setattr(ride, "stage", lambda e, rider, riders: (
        seen.add((rider.rows, rider.chunk, len(riders))) or real_stage(e, rider, riders)))
    gen = GenParams(max_new_tokens=9, ignore_eos=True)
    rng = random.Random(11)
    jobs = [[rng.randrange(64) for _ in range(rng.randrange(1, 24))] for _ in range(16)]
    want = [whole.generate(p, gen, spec) for p in jobs]
    started = serve(chunked, jobs, gen, spec)
    assert [s.output_ids for s in started] == [w.output_ids for w in want]
    # The drafts saw each rider's own prompt features (a wrong row drafts worse, losslessly).
    assert [s.accept_lengths for s in started] == [w.accept_lengths for w in want]
    assert any(rows == 1 for rows, _, _ in seen) and any(rows > 1 for rows, _, _ in seen)
    if spec.algorithm == "ddtree":  # its wide rounds take lone riders of 8 and four rows
        assert (1, 8, 1) in seen and any(rows == 4 > n for rows, _, n in seen)
    assert chunked.pool_usage()["free_slots"] == 4


@pytest.mark.parametrize("spec", [SpecParams("ar"), SpecParams("dflash")], ids=lambda s: s.algorithm)
def test_a_rider_of_several_rows_with_rows_to_spare_decodes_as_serial(pair, spec, monkeypatch):
    """Rows of one token (RIDE_ROW 1), so that the running streams' round takes several rider rows:
    a joiner of two tokens takes two, one of one token one more, and the rows left over write past
    the first rider's chunks. Both prompts are in after that one round, and every output is the
    serial one."""
    from ddtree.engine.reference.fast import ride

    monkeypatch.setattr(ride, "RIDE_MIN", 2)
    monkeypatch.setattr(ride, "RIDE_MAX", 8)
    monkeypatch.setattr(ride, "RIDE_ROW", 1)
    whole, engine = engines(pair, "fast", pool_slots=4)
    engine.impl.batch_static = True
    engine.mixed_chunk, engine.prefill_chunk = True, 8
    staged = []
    real_stage = ride.stage
    monkeypatch.setattr(ride, "stage", lambda e, rider, riders: (
        staged.append((rider.rows, ride.row_counts(e, riders, rider.rows, rider.chunk))) or real_stage(e, rider, riders)))
    gen = GenParams(max_new_tokens=8, ignore_eos=True)
    running = [engine.start(p, gen, spec) for p in ([1, 2, 3], [4, 5, 6, 7])]
    engine.step_many(running)  # their prefills: no round to ride yet
    prompts = [[9, 10], [11]]
    riders = [engine.start(p, gen, spec) for p in prompts]
    engine.step_many(running + riders)
    assert len(staged) == 1 and staged[0][1] == [2, 1] and staged[0][0] > 3  # rows to spare
    assert all(r._prefilled_rows == len(p) and r._bonus is not None for r, p in zip(riders, prompts))
    while not all(s.done for s in running + riders):
        engine.step_many([s for s in running + riders if not s.done])
    for s, p in zip(running + riders, ([1, 2, 3], [4, 5, 6, 7], *prompts)):
        assert s.output_ids == whole.generate(p, gen, spec).output_ids
    for s in running + riders:
        s.close()
    assert engine.pool_usage()["free_slots"] == 4


@pytest.mark.parametrize("backend,pooled", [("transformers", False), ("fast", False), ("fast", True)])
def test_step_many_leaves_new_sessions_past_the_prefill_cap_for_a_later_turn(pair, backend, pooled):
    """With max_prefill_tokens, the new sessions whose next prefill step would take the call past
    the cap get [] and are untouched (the first always goes; one that fits may go ahead);
    turn_held counts them, and every output is still the serial one."""
    from ddtree.engine.reference.params import within_prefill_cap

    whole, capped = engines(pair, backend, **({"pool_slots": 4} if pooled else {}))
    if pooled:
        capped.impl.batch_static = True
    capped.max_prefill_tokens = 6  # one chunk of 4 and at most 2 tokens more
    gen = GenParams(max_new_tokens=8, ignore_eos=True)
    jobs = [(p, SPECS[i % len(SPECS)]) for i, p in enumerate(prompts(3, 10) + [[5, 6], list(range(2, 16))])]
    want = [whole.generate(p, gen, s).output_ids for p, s in jobs]
    active, out, nxt, held = [], {}, 0, 0
    while active or nxt < len(jobs):
        while nxt < len(jobs) and len(active) < 4:
            active.append((nxt, capped.start(jobs[nxt][0], gen, jobs[nxt][1])))
            nxt += 1
        new = [s for _, s in active if s._bonus is None]
        go = within_prefill_cap([s.next_prefill_tokens() for s in new], 6)
        before = [s._prefilled_rows for s in new]
        results = dict(zip(map(id, (s for _, s in active)), capped.step_many([s for _, s in active])))
        assert capped.turn_held == go.count(False)
        for s, ok, rows in zip(new, go, before):
            if not ok:
                assert results[id(s)] == [] and s._prefilled_rows == rows and not s.output_ids
        held += go.count(False)
        _collect_done(active, out)
    assert [out[j] for j in range(len(jobs))] == want
    assert held  # the cap held some back


def test_with_mixed_chunks_joiners_ride_together_under_a_cap_their_whole_chunks_pass(pair, monkeypatch):
    """Through the scheduler: riders take a slice of each joiner's next chunk (8 tokens here), so
    under a cap of 8, which two whole chunks pass, both joiners still ride in one round of two
    running streams (rows of 2 tokens). A scheduler counting whole chunks held all but one
    joiner a turn. Every output is still the serial one."""
    import threading

    from ddtree.engine.reference.fast import ride

    monkeypatch.setattr(ride, "RIDE_MIN", 2)
    monkeypatch.setattr(ride, "RIDE_MAX", 8)
    monkeypatch.setattr(ride, "RIDE_ROW", 2)
    whole, capped = engines(pair, "fast", pool_slots=4)
    capped.prefill_chunk, capped.max_prefill_tokens = 8, 8
    capped.impl.batch_static = True
    capped.mixed_chunk = True
    seen = []
    real_stage = ride.stage
    monkeypatch.setattr(ride, "stage", lambda e, rider, riders: (
        seen.append(len(riders)) or real_stage(e, rider, riders)))
    # The joiners arrive while the first turn (the two streams' prefills) runs, so the next
    # turn has them all beside two running streams, whatever the machine's timing.
    inside, submitted = threading.Event(), threading.Event()
    real_step_many = capped.step_many

    def gated(sessions):
        if not submitted.is_set():
            inside.set()
            submitted.wait(60)
        return real_step_many(sessions)
    monkeypatch.setattr(capped, "step_many", gated)
    gen = GenParams(max_new_tokens=9, ignore_eos=True)
    jobs = [[3, 4, 5], [6, 7]] + [list(range(k, k + 12)) for k in (1, 20)]
    spec = SpecParams("ddtree", 4)  # rounds of 2 x 5 rows: riders of 1 x 8 or up to 4 x 2 tokens
    want = [whole.generate(p, GenParams(max_new_tokens=30 if i < 2 else 9, ignore_eos=True), spec).output_ids
            for i, p in enumerate(jobs)]
    sched = Scheduler(capped, max_running=5, max_queued=5, batch=True)
    queues = [queue.Queue() for _ in jobs]
    for q, p in zip(queues[:2], jobs[:2]):
        sched.submit(p, GenParams(max_new_tokens=30, ignore_eos=True), spec, q.put)
    sched.start()
    try:
        assert inside.wait(60)
        for q, p in zip(queues[2:], jobs[2:]):
            sched.submit(p, gen, spec, q.put)
        submitted.set()
        outs = []
        for q in queues:
            ids = []
            while True:
                u = q.get(timeout=120)
                ids += u.new_ids
                if u.done:
                    break
            outs.append(ids)
    finally:
        sched.stop(timeout=30)
    assert outs == want
    assert max(seen) == 2  # two joiners rode one round, under a cap their whole chunks pass


def test_turns_alone_follows_the_prefill_cap():
    """What ride.burst weighs riding against: the turns prefilling alone takes, a chunk of each
    prompt a turn, as many as the cap lets through (the first always)."""
    from ddtree.engine.reference.fast.ride import turns_alone

    assert turns_alone([300, 50, 120], 128, 0) == 3  # no cap: the longest prompt's chunks
    assert turns_alone([300, 50, 120], 128, 256) == 3  # 128+50, then 128+120 (50 is done), then 44
    assert turns_alone([100, 100, 100, 100], 128, 150) == 4  # one a turn
    assert turns_alone([100, 100, 100, 100], 128, 10) == 4  # over the cap, the first still goes
    assert turns_alone([], 128, 10) == 0
    assert turns_alone([100, 100, 100, 100], 128, 150, most=2) == 2  # counting stops there
    assert turns_alone([300, 50], 0, 0) == 1  # no chunk: each prompt whole


def test_rider_shapes_stay_within_the_prefill_cap(pair):
    from ddtree.engine.reference.fast import ride

    _, engine = engines(pair, "fast", pool_slots=2)
    engine.prefill_chunk = 2048
    assert ride.shapes(engine, 10**6) == [(1, 128), (1, 512), (8, 64)]
    engine.max_prefill_tokens = 512
    assert ride.shapes(engine, 10**6) == [(1, 128), (1, 512), (8, 64)]
    engine.max_prefill_tokens = 300  # a lone rider as wide as the cap; four rows of 64
    assert ride.shapes(engine, 10**6) == [(1, 128), (1, 300), (4, 64)]
    engine.max_prefill_tokens = 100
    assert ride.shapes(engine, 10**6) == [(1, 64), (1, 100)]
    engine.max_prefill_tokens = 64  # below the narrowest rider: one rider as wide as the cap
    assert ride.shapes(engine, 10**6) == [(1, 64)]
