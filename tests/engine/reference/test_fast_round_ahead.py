"""AR rounds on the pool run ahead of the host (fast/batch_graph.py), on a CPU.

The graphed round's code runs without graphs here (FastPath.batch_static): the round after each
one is computed before the host reads the one before it, and taken by the next turn over the same
sessions. What must hold: every session decodes exactly what it decodes alone; a round run ahead
is taken when its sessions (or those of them still running) come back, and dropped otherwise,
with each session's device length then equal to its host length; nothing runs ahead where the
next round cannot be known.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast import batch_graph

from .conftest import make_drafter, make_target

AR = SpecParams("ar")


@pytest.fixture(scope="module")
def pair():
    model = make_target(0)
    return model, make_drafter(model, block_size=8, seed=1)


def _engine(pair, slots: int = 4) -> Engine:
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=slots)
    engine.impl.batch_static = True
    return engine


def _serial(pair, jobs) -> list[list[int]]:
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=16)
    return [serial.generate(prompt, gen, spec).output_ids for prompt, gen, spec in jobs]


def _in_step(engine: Engine, sessions) -> None:
    """Each running session's device lengths are its host's, plus what a round run ahead with it
    added: in the target, the rows it committed (one for AR, read from its packed result); in
    the drafter, the features of the round before it (the session's pending rows)."""
    stage = engine.impl._round_stage
    pending = stage.ahead if stage is not None else None
    pool = engine.impl.pool
    for s in sessions:
        if s.done:
            continue
        slot = s._cache.slot
        row = pending.rows.get(slot) if pending is not None else None
        ahead = row is not None and row[0]() is s
        committed = 0
        if ahead:
            committed = 1 if s.mode == "ar" else len(batch_graph.unpack_walks(pending.packed.tolist())[slot][0])
        assert int(pool.lengths[slot]) == s._cache.length + committed
        if s._draft_cache is not None and pool.dlengths is not None:
            appended = int(s._pending.shape[0]) if ahead else 0
            assert int(pool.dlengths[slot]) == s._draft_cache.length + appended


def _run_out(engine: Engine, sessions) -> None:
    """Step the running sessions together until every one is done, checking _in_step each turn."""
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
        _in_step(engine, sessions)


def _two_running(pair, length: int = 10):
    """(engine, sessions, their serial outputs): two AR sessions two turns in, their prefills and
    a round that ran the next one ahead."""
    jobs = [([5, 9, 11], length), ([7, 3], length)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    sessions = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs]
    engine.step_many(sessions)
    engine.step_many(sessions)
    return engine, sessions, want


def _counts(engine: Engine) -> dict:
    return dict(engine.impl.round_stage().ahead_counts)


def _finish(engine: Engine, sessions) -> None:
    for s in sessions:
        s.close()
    gc.collect()
    assert len(engine.impl._free) == engine.impl.pool.slots


def test_ar_rounds_run_ahead_and_decode_as_serial(pair):
    """Sessions of different lengths, one ended by a stop token: each turn takes the round run
    ahead in the last one, over those still running, and none is dropped."""
    prompts = [[5, 9, 11], [7, 3], [1, 2, 3, 4], [8]]
    lengths = [3, 7, 12, 20]
    plain = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in zip(prompts, lengths)])
    stop = plain[3][5]  # the fourth session stops there, a round its row was run ahead for
    gens = [GenParams(max_new_tokens=n, stop_token_ids=(stop,) if i == 3 else ())
            for i, n in enumerate(lengths)]
    want = _serial(pair, [(p, g, AR) for p, g in zip(prompts, gens)])
    assert len(want[3]) < 20
    engine = _engine(pair)
    static = []
    real = batch_graph.static_round
    sessions = [engine.start(p, g, AR) for p, g in zip(prompts, gens)]
    engine.step_many(sessions)  # the prefills
    turns = 0
    try:
        batch_graph.static_round = lambda *a, **k: static.append(1) or real(*a, **k)
        while not all(s.done for s in sessions):
            engine.step_many([s for s in sessions if not s.done])
            turns += 1
            _in_step(engine, sessions)
    finally:
        batch_graph.static_round = real
    assert [s.output_ids for s in sessions] == want
    counts = _counts(engine)
    assert counts["dropped"] == 0
    assert counts["taken"] == turns - 1  # every turn after the first
    # Each turn launched one round: the first its own and the next; the others only the next,
    # and none once every session still running would end in the round being read.
    assert len(static) == 1 + counts["launched"]
    assert engine.impl.round_stage().ahead is None  # the last round had no next
    _finish(engine, sessions)


@pytest.mark.parametrize("mixed", [False, True], ids=["beside", "mixed-chunks"])
def test_a_joiner_in_a_turn_whose_round_ran_ahead(pair, mixed):
    """A new session in a turn whose round has run ahead: the round is taken. The prompt cannot
    ride in a round that has run: it prefills beside it, or with mixed chunks it waits that turn
    (no running stream waits for a prefill of its own) and rides in the next. No round runs
    ahead of a turn with a joiner, and nothing is dropped."""
    jobs = [([5, 9, 11], 12), ([7, 3], 12), ([1, 2, 3, 4, 6, 2, 9], 9)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    if mixed:
        engine.mixed_chunk, engine.prefill_chunk = True, 4
    first = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs[:2]]
    engine.step_many(first)
    engine.step_many(first)
    engine.step_many(first)
    assert engine.impl.round_stage().ahead is not None
    joiner = engine.start(jobs[2][0], GenParams(max_new_tokens=jobs[2][1]), AR)
    sessions = first + [joiner]
    engine.step_many(sessions)
    assert _counts(engine)["taken"] == 2 and engine.impl.round_stage().ahead is None
    assert bool(joiner.output_ids) != mixed and (engine.turn_held == 1) == mixed
    _in_step(engine, sessions)
    _run_out(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    assert _counts(engine)["dropped"] == 0
    _finish(engine, sessions)


def test_a_joiner_prefilled_in_a_call_of_its_own_costs_no_round(pair):
    """As the scheduler runs a turn without mixed chunks: the new session's prefill first, then
    the running sessions' round. That round runs none ahead (the joiner is in the next one), so
    nothing is dropped."""
    jobs = [([5, 9, 11], 10), ([7, 3], 10), ([1, 2, 3], 6)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    running = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs[:2]]
    engine.step_many(running)
    engine.step_many(running)
    engine.step_many(running)
    joiner = engine.start(jobs[2][0], GenParams(max_new_tokens=jobs[2][1]), AR)
    engine.step_many([joiner])
    engine.step_many(running)
    assert engine.impl.round_stage().ahead is None
    sessions = running + [joiner]
    _run_out(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    assert _counts(engine)["dropped"] == 0 and _counts(engine)["taken"] > 0
    _finish(engine, sessions)


def test_a_session_stepping_alone_drops_the_round_run_ahead(pair):
    engine, sessions, want = _two_running(pair)
    assert engine.impl.round_stage().ahead is not None
    sessions[0].step()  # on its slot's own path: the host's length must be the device's
    assert _counts(engine)["dropped"] == 1 and engine.impl.round_stage().ahead is None
    _in_step(engine, sessions)
    _run_out(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    _finish(engine, sessions)


@pytest.mark.parametrize("joiner", [(GenParams(max_new_tokens=6), SpecParams("ddtree", 4)),
                                    (GenParams(max_new_tokens=6, temperature=0.8, seed=3), AR)],
                         ids=["ddtree", "sampled"])
def test_another_round_mix_drops_the_round_run_ahead(pair, joiner):
    """A DDTree or a sampled session joins the AR sessions after their next round has run
    ahead: that round goes back, the mix runs the eager round, and all decode as serial."""
    jobs = [([5, 9, 11], GenParams(max_new_tokens=14), AR), ([7, 3], GenParams(max_new_tokens=14), AR),
            ([4, 4, 2], *joiner)]
    want = _serial(pair, jobs)
    engine = _engine(pair)
    sessions = [engine.start(*jobs[i]) for i in range(2)]
    engine.step_many(sessions)
    engine.step_many(sessions)
    sessions.append(engine.start(*jobs[2]))
    engine.step_many(sessions[2:])  # its prefill, in a call of its own: nothing dropped yet
    assert engine.impl.round_stage().ahead is not None
    _run_out(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    assert _counts(engine)["dropped"] == 1
    _finish(engine, sessions)


def test_a_round_over_some_of_the_sessions_run_ahead_drops_it(pair):
    """Only those that ended may be missing: a session still running whose row ran ahead and
    is not in the round would keep a device length one past its host's."""
    engine, sessions, want = _two_running(pair)
    engine.step_many(sessions[:1])
    assert _counts(engine)["dropped"] == 1
    _in_step(engine, sessions)
    _run_out(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    _finish(engine, sessions)


def test_a_taken_round_that_fails_leaves_a_session_prefilled_since_as_it_is(pair, monkeypatch):
    """The scheduler prefills a joiner in a call of its own, then the running sessions' round
    (the one run ahead) raises: only that round's sessions go back, the joiner's prefilled rows
    stay (a copy of every length taken a turn earlier would have zeroed its length)."""
    jobs = [([5, 9, 11], 10), ([7, 3], 10), ([1, 2, 3, 4], 8)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    running = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs[:2]]
    engine.step_many(running)
    engine.step_many(running)
    joiner = engine.start(jobs[2][0], GenParams(max_new_tokens=jobs[2][1]), AR)
    engine.step_many([joiner])
    before = [(list(s.output_ids), s._cache.length) for s in running]
    real = batch_graph.unpack_walks
    monkeypatch.setattr(batch_graph, "unpack_walks", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        engine.step_many(running)
    monkeypatch.setattr(batch_graph, "unpack_walks", real)
    assert [(list(s.output_ids), s._cache.length) for s in running] == before
    sessions = running + [joiner]
    _in_step(engine, sessions)
    _run_out(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    _finish(engine, sessions)


def test_no_round_runs_ahead_for_one_session_left_on_its_slots_own_graphs(pair):
    """It steps alone next (Engine.lone_round), which would only drop it."""
    engine = _engine(pair)
    pair_ = [engine.start([5, 9, 11], GenParams(max_new_tokens=n), AR) for n in (2, 12)]
    short, long = pair_
    engine.step_many(pair_)  # the prefills: one token each
    long._cache.graphs[(1, 8)] = object()  # as FastTarget.capture leaves a graphed slot's cache
    engine.step_many(pair_)  # short's last round: the next would be long's alone
    assert short.done and engine.impl.round_stage().ahead is None
    long._cache.graphs.clear()
    engine.step_many([long])  # on a slot without graphs it takes the pool's round: one runs ahead
    assert engine.impl.round_stage().ahead is not None
    _finish(engine, pair_)


def test_nothing_runs_ahead_when_off_or_timed(pair):
    jobs = [([5, 9, 11], 6), ([7, 3], 6)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    for setting in ("off", "timed"):
        engine = _engine(pair)
        if setting == "off":
            engine.impl.round_ahead = False
        else:
            engine.sync_timings = True
        sessions = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs]
        while not all(s.done for s in sessions):
            engine.step_many([s for s in sessions if not s.done])
            assert engine.impl.round_stage().ahead is None
        assert [s.output_ids for s in sessions] == want
        assert _counts(engine) == {"launched": 0, "taken": 0, "dropped": 0}
        _finish(engine, sessions)


def test_a_round_that_fails_after_its_next_is_queued_changes_no_session(pair, monkeypatch):
    """The round run ahead raises: the turn's round is undone with it (the lengths go back to
    the turn's start), nothing is left to take, and decoding goes on as serial."""
    engine, sessions, want = _two_running(pair, 9)
    before = [(list(s.output_ids), s._cache.length) for s in sessions]
    real = batch_graph.static_round
    batch_graph.drop_ahead(engine)  # so this turn launches its own round, then the next
    calls = []

    def second_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*a, **k)
    monkeypatch.setattr(batch_graph, "static_round", second_fails)
    with pytest.raises(RuntimeError):
        engine.step_many(sessions)
    assert [(list(s.output_ids), s._cache.length) for s in sessions] == before
    assert engine.impl.round_stage().ahead is None
    monkeypatch.setattr(batch_graph, "static_round", real)
    _in_step(engine, sessions)
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == want
    _finish(engine, sessions)


@pytest.mark.parametrize("spec", [SpecParams("dflash"), SpecParams("ddtree", 4), SpecParams("ddtree", 16)],
                         ids=lambda s: f"{s.algorithm}{s.budget}")
def test_drafting_rounds_run_ahead_and_decode_as_serial(pair, spec):
    """DFlash and DDTree rounds too: the drafter's rows, the staged features and the bonus are
    the device's; only the depth caps come from the host, set for the worst case. Sessions of
    different lengths, a joiner, a session stepping alone (a drop) and the end of each decode as
    serial, with every device length (the drafter's too) the host's plus the round run ahead."""
    prompts = [[5, 9, 11], [7, 3], [1, 2, 3, 4], [8], [6, 6, 1, 2, 9]]
    lengths = [4, 11, 25, 40, 18]
    jobs = [(p, GenParams(max_new_tokens=n), spec) for p, n in zip(prompts, lengths)]
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=16)
    alone = [serial.generate(*job) for job in jobs]
    want = [s.output_ids for s in alone]
    engine = _engine(pair, slots=5)
    sessions = [engine.start(*job) for job in jobs[:4]]
    turn = 0
    while not all(s.done for s in sessions) or len(sessions) < 5:
        if turn == 5:
            sessions.append(engine.start(*jobs[4]))
        live = [s for s in sessions if not s.done]
        if turn == 9 and not live[1].done:
            live[1].step()  # alone: the round run ahead goes back
            _in_step(engine, sessions)
        engine.step_many(live)
        _in_step(engine, sessions)
        turn += 1
    assert [s.output_ids for s in sessions] == want
    # Booked as the serial rounds are, the last ones too (their trees may go past the tokens
    # wanted: Session._advance books what they commit).
    assert [s.accept_lengths for s in sessions] == [s.accept_lengths for s in alone]
    counts = _counts(engine)
    assert counts["taken"] > 5 and counts["dropped"] == 1
    _finish(engine, sessions)


@pytest.mark.parametrize("spec", [AR, SpecParams("ddtree", 16)], ids=lambda s: s.algorithm)
def test_a_round_run_ahead_stops_at_the_context_window(pair, spec):
    """Its depth caps assume the round before it accepted all it could: a session near the
    window ends where it ends decoding serially (a deeper cap would commit past it)."""
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=16, context_window=40)
    pooled = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=4, context_window=40)
    pooled.impl.batch_static = True
    jobs = [([5, 9, 11] * 4, GenParams(max_new_tokens=200), spec), ([7, 3] * 3, GenParams(max_new_tokens=200), spec),
            ([1, 2], GenParams(max_new_tokens=200), spec)]
    want = [serial.generate(*job).output_ids for job in jobs]
    sessions = [pooled.start(*job) for job in jobs]
    _run_out(pooled, sessions)
    assert [s.output_ids for s in sessions] == want
    assert all(s.finish_reason == "length" and s._start <= 40 for s in sessions)
    assert _counts(pooled)["taken"] > 5
    _finish(pooled, sessions)


def test_a_device_length_check_sees_a_wrong_length(pair):
    """The check the tests above lean on fails where a session's device length is off."""
    engine = _engine(pair)
    sessions = [engine.start([5, 9, 11], GenParams(max_new_tokens=6), AR) for _ in range(2)]
    engine.step_many(sessions)
    engine.step_many(sessions)
    engine.impl.pool.lengths[sessions[0]._cache.slot] += 1
    with pytest.raises(AssertionError):
        _in_step(engine, sessions)
    _finish(engine, sessions)


@pytest.mark.parametrize("limit", ["window", "length"])
def test_the_demo_pairs_long_accepted_paths_end_where_serial_ones_do(limit):
    """With a trained drafter whole blocks get accepted. Near the window, a round run ahead
    whose depth caps trusted the host's state from before the round in flight would write past
    the cache; near the length limit its path may go past the tokens wanted, and is booked at
    what it commits, so even the acceptance is the serial one's."""
    root = Path(__file__).resolve().parents[3] / "assets" / "demo"
    if not (root / "target" / "config.json").is_file():
        pytest.skip("the demo pair is not in assets/demo")
    window, wanted = (96, 400) if limit == "window" else (512, 29)
    serial = Engine.load(root / "target", root / "drafter", backend="fast", context_window=window)
    pooled = Engine.load(root / "target", root / "drafter", backend="fast", context_window=window, pool_slots=4)
    pooled.impl.batch_static = True
    prompts = [serial.tokenizer.encode(text) for text in ("def fibonacci(n):", "class Stack:\n    def push(self, x):",
                                                           "import os\n\ndef list_files(path):")]
    jobs = [(p, GenParams(max_new_tokens=wanted, ignore_eos=True), SpecParams("ddtree", 8)) for p in prompts]
    want = [serial.generate(*job) for job in jobs]
    assert max(max(s.accept_lengths) for s in want) >= 4  # long accepted paths, or this tests nothing
    sessions = [pooled.start(*job) for job in jobs]
    _run_out(pooled, sessions)
    assert [s.output_ids for s in sessions] == [s.output_ids for s in want]
    if limit == "length":
        assert [s.accept_lengths for s in sessions] == [s.accept_lengths for s in want]
    assert _counts(pooled)["taken"] > 5
    _finish(pooled, sessions)
