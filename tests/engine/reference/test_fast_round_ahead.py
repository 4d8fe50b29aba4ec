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
    """Each running session's device length is its host length, plus one where a round run
    ahead holds it."""
    stage = engine.impl._round_stage
    pending = stage.ahead if stage is not None else None
    for s in sessions:
        if s.done:
            continue
        row = pending.rows.get(s._cache.slot) if pending is not None else None
        ahead = 1 if row is not None and row[0]() is s else 0
        assert int(engine.impl.pool.lengths[s._cache.slot]) == s._cache.length + ahead


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


def test_a_joiner_prefills_beside_the_round_run_ahead(pair):
    """A new session in a turn whose round has run ahead: the round is taken and the prompt
    prefills beside it, with mixed chunks on too (a round that has run takes no riders); no
    round runs ahead of a turn with a joiner."""
    jobs = [([5, 9, 11], 12), ([7, 3], 12), ([1, 2, 3, 4, 6, 2, 9], 9)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    for mixed in (False, True):
        engine = _engine(pair)
        engine.mixed_chunk = mixed
        first = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs[:2]]
        engine.step_many(first)
        engine.step_many(first)
        engine.step_many(first)
        assert engine.impl.round_stage().ahead is not None
        joiner = engine.start(jobs[2][0], GenParams(max_new_tokens=jobs[2][1]), AR)
        sessions = first + [joiner]
        engine.step_many(sessions)
        assert joiner.output_ids and _counts(engine)["taken"] == 2
        assert engine.impl.round_stage().ahead is None
        _in_step(engine, sessions)
        while not all(s.done for s in sessions):
            engine.step_many([s for s in sessions if not s.done])
            _in_step(engine, sessions)
        assert [s.output_ids for s in sessions] == want, mixed
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
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
        _in_step(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    assert _counts(engine)["dropped"] == 0 and _counts(engine)["taken"] > 0
    _finish(engine, sessions)


def test_a_session_stepping_alone_drops_the_round_run_ahead(pair):
    jobs = [([5, 9, 11], 10), ([7, 3], 10)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    sessions = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs]
    engine.step_many(sessions)
    engine.step_many(sessions)
    assert engine.impl.round_stage().ahead is not None
    sessions[0].step()  # on its slot's own path: the host's length must be the device's
    assert _counts(engine)["dropped"] == 1 and engine.impl.round_stage().ahead is None
    _in_step(engine, sessions)
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
        _in_step(engine, sessions)
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
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
        _in_step(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    assert _counts(engine)["dropped"] == 1
    _finish(engine, sessions)


def test_a_round_over_some_of_the_sessions_run_ahead_drops_it(pair):
    """Only those that ended may be missing: a session still running whose row ran ahead and
    is not in the round would keep a device length one past its host's."""
    jobs = [([5, 9, 11], 10), ([7, 3], 10)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    sessions = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs]
    engine.step_many(sessions)
    engine.step_many(sessions)
    engine.step_many(sessions[:1])
    assert _counts(engine)["dropped"] == 1
    _in_step(engine, sessions)
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
        _in_step(engine, sessions)
    assert [s.output_ids for s in sessions] == want
    _finish(engine, sessions)


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
    jobs = [([5, 9, 11], 9), ([7, 3], 9)]
    want = _serial(pair, [(p, GenParams(max_new_tokens=n), AR) for p, n in jobs])
    engine = _engine(pair)
    sessions = [engine.start(p, GenParams(max_new_tokens=n), AR) for p, n in jobs]
    engine.step_many(sessions)
    engine.step_many(sessions)
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


def test_only_ar_rounds_run_ahead():
    engine = type("E", (), {})()
    engine.impl = type("I", (), {"round_ahead": True})()
    engine.sync_timings = False
    assert batch_graph.runs_ahead(engine, ("ar", 0))
    assert not batch_graph.runs_ahead(engine, ("chain", 0))
    assert not batch_graph.runs_ahead(engine, ("tree", 16))


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
