"""A lone greedy AR session's next step queued before the host reads its token
(fast/step_ahead.py), on the slot path that CUDA graphs capture, run on a CPU.

What must hold: the tokens are the reference's; every step of a request after its first takes
the step run ahead of it; the host's length and the device's stay equal (the row a step run
ahead writes is booked only when it is taken); a step run ahead that is not taken (a stop token,
another session, a batched round in between) is dropped and changes no token; nothing runs
ahead where the next step is unknown, timed, sampled or switched off.
"""

from __future__ import annotations

import pytest

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

from .conftest import make_drafter, make_target
from .test_fast_round_host import PROMPTS, _fast

AR = SpecParams("ar")


@pytest.fixture(scope="module")
def reference():
    model = make_target(63)
    return Engine(model, make_drafter(model, block_size=8, seed=5))


def _steps(engine: Engine) -> dict:
    return dict(engine.impl.steps.counts)


def _step_checked(sess) -> list[int]:
    """One step, then the device length must be the host's: a step run ahead wrote its row past
    the length and must not have counted it."""
    out = sess.step()
    if not sess.done:
        assert int(sess._cache.length_t) == sess._cache.length == sess._start
    return out


def test_steps_run_ahead_decode_what_the_reference_decodes(reference):
    fast = _fast(1)
    gen = GenParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        sess = fast.start(prompt, gen, AR)
        while not sess.done:
            _step_checked(sess)
        assert sess.output_ids == reference.generate(prompt, gen, AR).output_ids
    # Per request: the prefill gives the first token, then 39 steps. The first runs none ahead (a
    # session's first step here might be one of several taking turns), the last none either (no
    # token is wanted after it); each of the 37 between does, and the next step takes it.
    assert _steps(fast) == {"launched": 37 * len(PROMPTS), "taken": 37 * len(PROMPTS), "dropped": 0}


def test_a_step_run_ahead_of_a_stop_token_is_dropped_and_changes_nothing(reference):
    fast = _fast(1)
    prompt = PROMPTS[0]
    full = reference.generate(prompt, GenParams(max_new_tokens=30, ignore_eos=True), AR).output_ids
    stop = next(t for i, t in enumerate(full) if i >= 6 and t not in full[:i])  # first met mid-way
    gen = GenParams(max_new_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    want = reference.generate(prompt, gen, AR)
    assert want.finish_reason == "stop" and len(want.output_ids) < 30
    got = fast.generate(prompt, gen, AR)
    assert got.output_ids == want.output_ids and got.finish_reason == "stop"
    assert _steps(fast)["launched"] == _steps(fast)["taken"] + 1  # the step after the stop token
    # The slot's next session starts over it: the stale step is dropped, not taken.
    again = fast.generate(PROMPTS[1], GenParams(max_new_tokens=20, ignore_eos=True), AR)
    assert again.output_ids == reference.generate(PROMPTS[1], GenParams(max_new_tokens=20, ignore_eos=True),
                                                  AR).output_ids
    assert _steps(fast)["dropped"] == 1


def test_sessions_stepping_in_turn_run_nothing_ahead_and_decode_as_alone(reference):
    """Two sessions on two slots stepped one after the other (no batching): a step run ahead
    would be dropped by the other's every time, so none runs, and every token is still right."""
    fast = _fast(2)
    gen = GenParams(max_new_tokens=16, ignore_eos=True)
    a, b = fast.start(PROMPTS[0], gen, AR), fast.start(PROMPTS[1], gen, AR)
    while not (a.done and b.done):
        for s in (a, b):
            if not s.done:
                _step_checked(s)
    assert a.output_ids == reference.generate(PROMPTS[0], gen, AR).output_ids
    assert b.output_ids == reference.generate(PROMPTS[1], gen, AR).output_ids
    assert _steps(fast) == {"launched": 0, "taken": 0, "dropped": 0}


def test_a_step_run_ahead_is_taken_by_its_own_session_only(reference):
    """A session's step run ahead at position p, then another session whose cache holds p rows
    steps: it runs its own step (a take by position alone would give it the first one's token)."""
    fast = _fast(2)
    gen = GenParams(max_new_tokens=12, ignore_eos=True)
    a = fast.start([3, 1, 4], gen, AR)
    for _ in range(3):
        _step_checked(a)  # the prefill, a step, a step that runs the next one ahead (at 5 rows)
    assert fast.impl.steps.pending is not None and fast.impl.steps.pending[1] == a._cache.length == 5
    b = fast.start([9, 2, 6, 5, 3], gen, AR)
    while not b.done:
        _step_checked(b)
    assert b.output_ids == reference.generate([9, 2, 6, 5, 3], gen, AR).output_ids
    while not a.done:
        _step_checked(a)
    assert a.output_ids == reference.generate([3, 1, 4], gen, AR).output_ids


def test_the_next_step_is_queued_before_the_host_waits_for_this_token(monkeypatch):
    """The overlap itself: between recording the token's read and waiting for it, the next step
    is queued (on a CPU the event is a stand-in, but the order is the one CUDA runs)."""
    fast = _fast(1)
    steps = fast.impl.steps
    seen = []

    class Probe:
        def record(self, stream=None):
            seen.append(("record", steps.counts["launched"]))

        def synchronize(self):
            seen.append(("wait", steps.counts["launched"]))
    monkeypatch.setattr(steps, "_read", Probe())
    fast.generate(PROMPTS[0], GenParams(max_new_tokens=10, ignore_eos=True), AR)
    pairs = list(zip(seen[::2], seen[1::2]))
    assert len(pairs) == steps.counts["launched"] == 7
    assert all(r[0] == "record" and w[0] == "wait" and w[1] == r[1] + 1 for r, w in pairs)


def _pooled() -> tuple[Engine, Engine]:
    """(an engine without a pool, one with a 4-slot KV pool whose rounds and lone steps run the
    code graphs capture) over the same tiny pair."""
    model = make_target(0)
    drafter = make_drafter(model, block_size=8, seed=1)
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=4)
    engine.impl.batch_static = True
    engine.target.static = True
    return Engine(model, drafter, backend="fast", max_budget=16), engine


def test_a_session_between_lone_steps_and_pool_rounds_decodes_as_serial():
    """On a KV pool, a session steps alone (its next step run ahead), then rides batched rounds
    beside a joiner (which compute that step again), then steps alone once more: the step run
    ahead before the batched rounds is dropped, and both decode what they decode serially."""
    serial, engine = _pooled()
    gen = GenParams(max_new_tokens=24, ignore_eos=True)
    a = engine.start([5, 9, 11], gen, AR)
    for _ in range(4):
        _step_checked(a)
    assert _steps(engine)["launched"] >= 2
    b = engine.start([7, 3], GenParams(max_new_tokens=8, ignore_eos=True), AR)
    while not b.done:
        engine.step_many([a, b])
    while not a.done:
        _step_checked(a)
    assert a.output_ids == serial.generate([5, 9, 11], gen, AR).output_ids
    assert b.output_ids == serial.generate([7, 3], GenParams(max_new_tokens=8, ignore_eos=True), AR).output_ids
    assert _steps(engine)["dropped"] >= 1


def test_a_batched_round_without_a_session_drops_its_step_run_ahead():
    """A pooled session stepping alone while batched rounds run over another: each round writes
    past the first session's length as an inactive row, over the row its step run ahead wrote,
    so that step must be dropped, not booked (fast/batch.step_many); it decodes as serial."""
    serial, engine = _pooled()
    gen = GenParams(max_new_tokens=24, ignore_eos=True)
    a, b = engine.start([5, 9, 11], gen, AR), engine.start([7, 3], gen, AR)
    a.step(), b.step()  # the prefills
    while not a.done:
        _step_checked(a)
        if not b.done:
            engine.step_many([b])
    assert a.output_ids == serial.generate([5, 9, 11], gen, AR).output_ids
    assert _steps(engine)["launched"] > 0 and _steps(engine)["taken"] == 0


@pytest.mark.parametrize("case", ["timed", "off", "sampled", "dflash"])
def test_nothing_runs_ahead_where_the_next_step_is_not_known_or_not_wanted(case, reference):
    fast = _fast(1)
    gen = GenParams(max_new_tokens=20, ignore_eos=True)
    spec = AR
    if case == "timed":
        fast.sync_timings = True  # each part of a round is timed after the GPU drains
    elif case == "off":
        fast.impl.round_ahead = False  # the server's --disable-overlap-schedule
    elif case == "sampled":
        gen = GenParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3)
    else:
        spec = SpecParams("dflash")  # its last rounds step without a draft, features on
    got = fast.generate(PROMPTS[0], gen, spec)
    assert _steps(fast)["launched"] == 0
    if gen.greedy:
        assert got.output_ids == reference.generate(PROMPTS[0], gen, spec).output_ids


def test_steps_ahead_are_counted_in_the_pool_usage():
    model = make_target(0)
    engine = Engine(model, make_drafter(model, block_size=8, seed=1), backend="fast", max_budget=16,
                    pool_slots=2)
    engine.target.static = True
    engine.generate([5, 9, 11], GenParams(max_new_tokens=10, ignore_eos=True), AR)
    assert engine.pool_usage()["steps_ahead"] == {"launched": 7, "taken": 7, "dropped": 0}


def test_round_ahead_says_whether_steps_run_ahead_without_a_pool(reference):
    """/server_info's disable_overlap_schedule is `not engine.round_ahead`: a fast engine
    without a KV pool runs its lone AR steps ahead, so it must read true there, and false once
    the switch is off or where nothing static serves a step."""
    fast = _fast(1)
    assert fast.impl.pool is None and fast.round_ahead
    fast.generate(PROMPTS[0], GenParams(max_new_tokens=8, ignore_eos=True), AR)
    assert _steps(fast)["launched"] > 0
    fast.impl.round_ahead = False
    assert not fast.round_ahead
    eager = Engine(reference.model, reference.drafter, backend="fast", max_budget=32)
    eager.target.static = False
    assert not eager.round_ahead
    assert not reference.round_ahead  # the transformers backend runs nothing ahead
