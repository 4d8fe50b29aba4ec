"""The round-robin scheduler against a double of the Session API (no torch, no HTTP)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.scheduler import EngineThread, QueueFull, Scheduler, ShuttingDown, render_metrics


@dataclass(frozen=True)
class Gen:
    max_new_tokens: int


@dataclass(frozen=True)
class Spec:
    algorithm: str = "ddtree"
    budget: int = 4


class FakeSession:
    """Commits 2 tokens per round (tau = 2); token values name the request and the round."""

    def __init__(self, engine, ids, gen, spec):
        self.engine, self.tag, self.n = engine, ids[0], gen.max_new_tokens
        self.output_ids, self.accept_lengths, self.verify_ct = [], [], 0
        self.done, self.finish_reason, self.closed = False, None, False

    def step(self):
        self.engine.log.append(self.tag)
        self.engine.step_threads.add(threading.get_ident())
        if self.tag == 666:
            raise RuntimeError("boom")
        if self.engine.gate is not None:
            self.engine.gate.wait()
        new = [self.tag * 1000 + len(self.output_ids) + i for i in range(2)][: self.n - len(self.output_ids)]
        self.output_ids += new
        self.accept_lengths.append(len(new))
        self.verify_ct += 1
        if len(self.output_ids) >= self.n:
            self.done, self.finish_reason = True, "length"
        if self.engine.after_step is not None:
            self.engine.after_step(self)
        return new

    def next_prefill_tokens(self):
        """The double's prompt is `tag` tokens long, prefilled in its first step."""
        return 0 if self.output_ids or self.done else self.tag

    def close(self):
        self.closed = True
        self.engine.open_sessions.discard(self)


class FakeEngine:
    block_size = 4

    def __init__(self):
        self.log, self.open_sessions, self.gate = [], set(), None
        self.after_step = None  # called on the engine thread after each round, with the session
        self.step_threads = set()

    def start(self, ids, gen, spec):
        if not ids:
            raise EngineError("empty prompt")
        s = FakeSession(self, ids, gen, spec)
        self.open_sessions.add(s)
        return s


def collect(sched, tag, n, **kw):
    q = queue.Queue()
    ticket = sched.submit([tag], Gen(n), Spec(**kw), q.put)
    return ticket, q


def drain(q, timeout=5.0):
    updates = []
    while True:
        u = q.get(timeout=timeout)
        updates.append(u)
        if u.done:
            return updates


def run_all(sched, queues) -> list[list]:
    """Start the loop, wait for each queue's final update, stop; each queue's updates."""
    sched.start()
    try:
        return [drain(q) for q in queues]
    finally:
        sched.stop(timeout=5)


@pytest.fixture
def engine_and_sched():
    engine = FakeEngine()
    sched = Scheduler(engine, max_running=3, max_queued=2)
    yield engine, sched
    sched.stop(timeout=5)


@pytest.fixture
def started(engine_and_sched):
    """engine_and_sched with the scheduler's loop running."""
    engine_and_sched[1].start()
    return engine_and_sched


def test_sessions_interleave_round_by_round(engine_and_sched):
    engine, sched = engine_and_sched
    engine.gate = threading.Event()
    _, q1 = collect(sched, 1, 20)
    _, q2 = collect(sched, 2, 4)
    sched.start()
    engine.gate.set()
    short = drain(q2)
    long = drain(q1)
    assert [i for u in short for i in u.new_ids] == [2000, 2001, 2002, 2003]
    assert len([i for u in long for i in u.new_ids]) == 20
    # The short request finished after two rounds of the long one, not after all ten.
    first_two = engine.log[:4]
    assert sorted(first_two) == [1, 1, 2, 2] and engine.log.index(2) < 2
    assert not engine.open_sessions


@pytest.mark.parametrize("batch", [False, True])
def test_a_request_submitted_mid_run_waits_rounds_not_the_long_run(batch):
    """Fairness in rounds, not seconds: a short request submitted while a long one decodes is
    admitted at the next turn and done after its own two rounds, the long one getting exactly one
    round per turn meanwhile. The submission happens inside the long one's third round, so the
    order of events is fixed and nothing races."""
    engine = BatchingEngine() if batch else FakeEngine()
    sched = Scheduler(engine, max_running=2, max_queued=2, batch=batch)
    short, submitted = {}, threading.Event()

    def submit_short(session):
        if session.tag == 1 and len(session.output_ids) == 6 and not short:
            short["log_at"] = len(engine.log)
            short["ticket"], short["queue"] = collect(sched, 2, 4)
            submitted.set()

    engine.after_step = submit_short
    _, long_q = collect(sched, 1, 40)
    sched.start()
    try:
        assert submitted.wait(timeout=10)
        short_updates = drain(short["queue"])
        long_updates = drain(long_q)
    finally:
        sched.stop(timeout=5)
    assert short["ticket"].submitted_turn == 3
    assert [u.turn for u in short_updates] == [4, 5]
    assert short_updates[-1].done and short_updates[-1].finish_reason == "length"
    # Between the submission and the short one's last round the long one ran one round per turn
    # (batched turns prefill the newcomer first, so only the counts are fixed, not the order).
    last_short_round = max(i for i, tag in enumerate(engine.log) if tag == 2)
    assert sorted(engine.log[short["log_at"]:last_short_round + 1]) == [1, 1, 2, 2]
    assert long_updates[-1].turn == 20 and short_updates[-1].turn < long_updates[-1].turn
    assert [u.turn for u in long_updates] == list(range(1, 21))


def test_updates_carry_rounds_and_final_reason(started):
    engine, sched = started
    _, q = collect(sched, 3, 5)
    updates = drain(q)
    assert [t for u in updates for t in u.new_accepts] == [2, 2, 1]
    assert updates[-1].finish_reason == "length" and updates[-1].verify_ct == 3
    assert sched.stats.generation_tokens_total == 5 and sched.stats.verify_calls_total == 3


def test_cancel_closes_the_session_at_once(engine_and_sched):
    engine, sched = engine_and_sched
    engine.gate = threading.Event()
    ticket, q = collect(sched, 4, 10_000)
    sched.start()
    engine.gate.set()
    q.get(timeout=5)
    ticket.cancel()
    final = drain(q)[-1]
    assert final.finish_reason == "abort"
    assert not engine.open_sessions
    assert sched.stats.aborted_total == 1


def test_queue_cap_refuses_past_running_plus_queued(engine_and_sched):
    engine, sched = engine_and_sched  # not started: everything stays queued
    for tag in range(5):
        collect(sched, 10 + tag, 4)
    with pytest.raises(QueueFull):
        collect(sched, 99, 4)


def test_a_failing_request_does_not_stop_the_others(started):
    engine, sched = started
    _, bad = collect(sched, 666, 4)
    _, good = collect(sched, 5, 4)
    final_bad = drain(bad)[-1]
    assert final_bad.error is not None and "boom" in str(final_bad.error)
    assert drain(good)[-1].finish_reason == "length"
    q = queue.Queue()
    sched.submit([], Gen(2), Spec(), q.put)
    assert "empty" in str(drain(q)[-1].error)
    assert not engine.open_sessions


def test_stop_fails_held_requests_and_refuses_new_ones():
    engine = FakeEngine()
    sched = Scheduler(engine, max_running=2, max_queued=2)
    _, q = collect(sched, 7, 4)
    sched.stop(timeout=1)
    final = drain(q)[-1]
    assert isinstance(final.error, ShuttingDown)
    with pytest.raises(ShuttingDown):
        collect(sched, 8, 4)


def test_render_metrics_parses(started):
    engine, sched = started
    _, q = collect(sched, 9, 6)
    drain(q)
    sched.stats.observe_ttft(0.02)
    text = render_metrics(sched.snapshot(time.perf_counter()), {"model_name": 'a "quoted"\\name'})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["sglang:spec_accept_length"].samples[0].value == 2.0
    assert families["sglang:spec_accept_rate"].samples[0].value == 0.25  # 1 correct of 4 proposed per round
    assert families["sglang:spec_verify_calls"].samples[0].value == 3
    assert families["sglang:num_running_reqs"].samples[0].labels["model_name"] == 'a "quoted"\\name'
    buckets = [s for s in families["sglang:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    # Late Triton compiles: a counter where something watches for them (CUDA graphs), else none.
    assert "ddtree:late_triton_compiles" not in families
    watched = dataclasses.replace(sched.snapshot(time.perf_counter()), late_compiles=2)
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(watched, {}))}
    assert families["ddtree:late_triton_compiles"].samples[0].value == 2


def test_turn_seconds_split_engine_calls_from_the_schedulers_own_time(engine_and_sched, monkeypatch):
    """A fake clock: each round takes 1 s inside the engine, each update's delivery 0.25 s of the
    scheduler's own time. One request of 6 tokens is 3 rounds in 3 turns (the first admits too)."""
    import types

    from ddtree.engine.reference import scheduler as scheduler_module

    engine, sched = engine_and_sched
    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine.after_step = lambda session: clock.__setitem__(0, clock[0] + 1.0)
    q = queue.Queue()

    def sink(update):
        clock[0] += 0.25
        q.put(update)

    sched.submit([3], Gen(6), Spec(), sink)
    sched.start()
    assert len(drain(q)) == 3
    sched.stop(timeout=5)
    stats = sched.stats.view(clock[0])
    assert stats.turns_total == 3
    assert stats.engine_seconds_total == 3.0
    assert stats.turn_seconds_total == 3.75
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(sched.snapshot(clock[0]), {}))}
    assert families["ddtree:scheduler_turns"].samples[0].value == 3
    assert families["ddtree:engine_seconds"].samples[0].value == 3.0


class BatchingEngine(FakeEngine):
    """FakeEngine with step_many: records each batch; a batch holding tag 777 fails as a whole."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def step_many(self, sessions):
        self.batches.append(sorted(s.tag for s in sessions))
        if any(s.tag == 777 for s in sessions):
            raise RuntimeError("batched forward failed")
        return [s.step() for s in sessions]


class LoneRoundEngine(BatchingEngine):
    """BatchingEngine whose sessions tagged 9 sit where stepping alone would be slow
    (Engine.lone_round: a pool slot without graphs of its own)."""

    def lone_round(self, session):
        return session.tag == 9 and bool(session.output_ids)


def test_a_lone_request_on_a_slot_without_graphs_still_goes_to_step_many(tmp_path):
    """The last request of a batch steps through step_many where the engine says it should
    (its pool slot has no graphs: alone would run eagerly), and alone elsewhere."""
    engine = LoneRoundEngine()
    trace = tmp_path / "turns.jsonl"
    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True, trace_turns=str(trace))
    queues = [collect(sched, tag, n)[1] for tag, n in ((9, 10), (2, 4))]
    outs = run_all(sched, queues)
    assert [[i for u in q for i in u.new_ids] for q in outs] == [[9000 + i for i in range(10)],
                                                                  [2000 + i for i in range(4)]]
    assert engine.batches[-3:] == [[9]] * 3  # 9 outlives 2 by three rounds of two tokens
    turns = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [t["how"] for t in turns[-3:]] == ["step"] * 3

    engine = LoneRoundEngine()
    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True)
    run_all(sched, [collect(sched, tag, n)[1] for tag, n in ((3, 10), (2, 4))])
    assert engine.batches[-1] == [2, 3] and engine.log[-3:] == [3, 3, 3]  # alone, as before


def test_batched_turns_step_all_running_sessions_at_once():
    engine = BatchingEngine()
    engine.gate = threading.Event()
    sched = Scheduler(engine, max_running=3, max_queued=4, batch=True)
    queues = [collect(sched, tag, n)[1] for tag, n in ((1, 10), (2, 4), (3, 4), (4, 4))]
    sched.start()
    engine.gate.set()
    try:
        outs = [[i for u in drain(q) for i in u.new_ids] for q in queues]
    finally:
        sched.stop(timeout=5)
    assert outs == [[1000 + i for i in range(10)], [2000 + i for i in range(4)], [3000 + i for i in range(4)],
                    [4000 + i for i in range(4)]]
    # The first rounds (prefills) of sessions admitted together run as one batch; then one batch
    # per turn, capped by max_running (4 waits for a free slot).
    assert engine.batches[0] == [1, 2, 3]
    assert all(len(b) <= 3 for b in engine.batches) and any(4 in b for b in engine.batches)
    assert not engine.open_sessions


@pytest.mark.parametrize("batch", [True, False])
def test_a_prefill_token_cap_spreads_a_burst_of_joiners_over_turns(tmp_path, batch):
    """With max_prefill_tokens 10, joiners of 4, 5, 6 and 12 prompt tokens (the double's tag) admitted
    in one turn prefill 4+5, then 6, then 12 (over the cap, but the first new one always goes):
    the ones held keep their place, the trace counts them, and every output is what it is
    without a cap."""
    engine = BatchingEngine()
    engine.max_prefill_tokens = 10
    engine.gate = threading.Event()
    trace = tmp_path / "turns.jsonl"
    sched = Scheduler(engine, max_running=4, max_queued=4, batch=batch, trace_turns=str(trace))
    queues = [collect(sched, tag, 6)[1] for tag in (4, 5, 6, 12)]
    sched.start()
    engine.gate.set()
    try:
        outs = [[i for u in drain(q) for i in u.new_ids] for q in queues]
    finally:
        sched.stop(timeout=5)
    assert outs == [[tag * 1000 + i for i in range(6)] for tag in (4, 5, 6, 12)]
    turns = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(t["new"], t["held"]) for t in turns[:3]] == [(2, 2), (1, 1), (1, 0)]
    firsts = [i for i, t in enumerate(turns) if t["firsts"]]
    assert firsts == [0, 1, 2]
    if batch:
        assert engine.batches[0] == [4, 5]  # the held ones were not in the first prefill


def test_within_prefill_cap():
    from ddtree.engine.reference.params import within_prefill_cap

    assert within_prefill_cap([4, 5, 6, 12], 10) == [True, True, False, False]
    assert within_prefill_cap([12, 4], 10) == [True, False]  # the first always goes
    assert within_prefill_cap([6, 7, 3], 10) == [True, False, True]  # a later one that fits goes ahead
    assert within_prefill_cap([6, 7, 3], 0) == [True, True, True]  # 0: no cap


class CappingEngine(BatchingEngine):
    """BatchingEngine with mixed chunks: step_many leaves the new sessions past its own cap
    untouched (as the fast engine does with what cannot ride) and counts them in turn_held."""

    mixed_chunk = True

    def __init__(self, cap):
        super().__init__()
        self.engine_cap, self.turn_held = cap, 0

    def step_many(self, sessions):
        from ddtree.engine.reference.params import within_prefill_cap

        new = [s for s in sessions if not s.output_ids]
        go = within_prefill_cap([s.next_prefill_tokens() for s in new], self.engine_cap)
        held = {id(s) for s, ok in zip(new, go) if not ok}
        self.turn_held = len(held)
        self.turn_parts = {"launch": 0.001, "round": 0.002} if new and len(new) < len(sessions) else {}
        self.turn_waits = {"push": 0.0005, "gpu": 0.002}
        out = super().step_many([s for s in sessions if id(s) not in held])
        results = iter(out)
        return [[] if id(s) in held else next(results) for s in sessions]


def joiners_beside_two_streams(engine, tmp_path) -> list[dict]:
    """Joiners of 4, 5, 6 and 12 prompt tokens (the double's tag) beside two running requests
    with mixed chunks and max_prefill_tokens 10; checks every output and returns the trace."""
    engine.max_prefill_tokens = 10
    trace = tmp_path / "turns.jsonl"
    sched = Scheduler(engine, max_running=6, max_queued=6, batch=True, trace_turns=str(trace))
    inside, submitted = threading.Event(), threading.Event()
    # The joiners arrive while the first turn (the two prefills) runs, so the next turn admits
    # all four beside two running requests, whatever the machine's timing.
    engine.after_step = lambda session: session.tag == 1 and (inside.set() or submitted.wait(30))
    running = [collect(sched, tag, 12)[1] for tag in (1, 2)]
    sched.start()
    try:
        assert inside.wait(30)
        joiners = [collect(sched, tag, 4)[1] for tag in (4, 5, 6, 12)]
        submitted.set()
        outs = [[i for u in drain(q) for i in u.new_ids] for q in joiners]
        for q in running:
            drain(q)
    finally:
        sched.stop(timeout=5)
    assert outs == [[tag * 1000 + i for i in range(4)] for tag in (4, 5, 6, 12)]
    return [json.loads(line) for line in trace.read_text().splitlines()]


def test_with_mixed_chunks_the_engine_caps_a_turn_that_steps_joiners_with_the_round(tmp_path):
    """A turn that steps new and running requests in one engine call (mixed chunks) is not capped
    by the scheduler, which cannot tell what of a joiner rides (a chunk) from what prefills on
    its own: every joiner goes to the engine, which caps the latter, and the trace's "held"
    counts what the engine held."""
    engine = CappingEngine(cap=15)  # what the engine takes of joiners is not what the scheduler sees
    turns = joiners_beside_two_streams(engine, tmp_path)
    joined = [b for b in engine.batches if 1 in b and 4 in b]
    assert joined and joined[0] == [1, 2, 4, 5, 6]  # every joiner reached the engine; it held 12
    together = [t for t in turns if t["how"] == "together"]
    assert together and together[0]["new"] == 3 and together[0]["held"] == 1
    # where the engine's time went, as it said (fast/batch.py's turn_parts)
    assert together[0]["parts"] == {"launch": 0.001, "round": 0.002}
    assert not any("parts" in t for t in turns if t["how"] != "together")
    # and its writes in the GPU's wait, and the wait after them (Engine.turn_waits)
    assert together[0]["waits"] == {"push": 0.0005, "gpu": 0.002}


class FailingTogetherEngine(CappingEngine):
    """A CappingEngine whose calls with new and running requests together always raise."""

    def step_many(self, sessions):
        if any(s.output_ids for s in sessions) and any(not s.output_ids for s in sessions):
            # what a failed call left must not count
            self.turn_held, self.turn_note, self.turn_parts = 99, "riders 2x8", {"round": 1.0}
            self.turn_waits = {"gpu": 1.0}
            raise RuntimeError("batched round failed")
        return super().step_many(sessions)


def test_a_failed_together_turn_steps_its_requests_alone_within_the_cap(tmp_path):
    """When the engine call of a together turn raises, the scheduler steps each request alone,
    and then it caps the new ones itself: 4 and 5 prefill (9 of 10 tokens), 6 and 12 wait."""
    engine = FailingTogetherEngine(cap=100)
    turns = joiners_beside_two_streams(engine, tmp_path)
    together = [t for t in turns if t["how"] == "together"]
    assert (together[0]["new"], together[0]["held"], together[0]["firsts"], together[0]["note"]) == (2, 2, 2, "")
    assert "parts" not in together[0] and "waits" not in together[0]


def test_no_cap_when_the_engine_has_none():
    engine = BatchingEngine()
    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True)
    queues = [collect(sched, tag, 2)[1] for tag in (400, 500)]
    run_all(sched, queues)
    assert engine.batches[0] == [400, 500]


def test_the_turn_trace_accounts_for_every_token_and_request(tmp_path):
    engine = BatchingEngine()
    trace = tmp_path / "turns.jsonl"
    sched = Scheduler(engine, max_running=3, max_queued=4, batch=True, trace_turns=str(trace))
    queues = [collect(sched, tag, n)[1] for tag, n in ((1, 10), (2, 4), (3, 4), (4, 4))]
    run_all(sched, queues)
    turns = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1))
    assert sum(t["tokens"] for t in turns) == 22 and sum(t["firsts"] for t in turns) == 4
    assert sum(t["admitted"] for t in turns) == 4
    assert turns[0]["how"] == "prefill" and turns[0]["new"] == 3 and turns[0]["running"] == 0
    assert {t["how"] for t in turns} <= {"prefill", "prefill+round", "prefill+step", "round", "step", "alone"}
    assert all(t["s"] >= t["engine_s"] >= 0 for t in turns)
    assert all(b["t"] >= a["t"] + a["s"] for a, b in zip(turns, turns[1:]))


def test_the_turn_trace_counts_a_garbage_collection_in_the_turn_it_ran(tmp_path):
    """A collection holds the GIL, so a turn it ran in is that much longer: the trace says so
    ("gc", seconds), and the hook goes when the loop stops."""
    import gc

    engine = FakeEngine()
    trace = tmp_path / "turns.jsonl"
    sched = Scheduler(engine, max_running=1, max_queued=4, trace_turns=str(trace))
    steps = []
    engine.after_step = lambda session: steps.append(1) or (len(steps) == 3 and gc.collect())
    gc.disable()  # only the collection above, not an automatic one in some other turn
    try:
        run_all(sched, [collect(sched, 1, 5)[1]])
    finally:
        gc.enable()
    turns = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [n for n, t in enumerate(turns, 1) if t.get("gc", 0) > 0] == [3]
    assert turns[2]["gc"] <= turns[2]["s"]
    assert not any(getattr(cb, "__self__", None) is sched for cb in gc.callbacks)


@pytest.mark.parametrize("where", ["/dev/full", "folder"])
def test_a_trace_that_cannot_be_written_stops_and_serving_goes_on(tmp_path, where, caplog):
    """A full disk (/dev/full takes the open and fails the writes) or a path that is a folder
    ends the trace with a warning; every request still finishes."""
    engine = BatchingEngine()
    path = "/dev/full" if where == "/dev/full" else str(tmp_path)
    if where == "/dev/full" and not os.path.exists(path):
        pytest.skip("no /dev/full here")
    sched = Scheduler(engine, max_running=3, max_queued=4, batch=True, trace_turns=path)
    queues = [collect(sched, tag, n)[1] for tag, n in ((1, 5), (2, 3))]
    with caplog.at_level(logging.WARNING):
        sched.start()
        try:
            outs = [[i for u in drain(q) for i in u.new_ids] for q in queues]
        finally:
            sched.stop(timeout=5)
    assert outs == [[1000 + i for i in range(5)], [2000 + i for i in range(3)]]
    assert "turn trace" in caplog.text and sched.failure is None


def test_a_failing_batch_falls_back_to_single_steps():
    engine = BatchingEngine()
    sched = Scheduler(engine, max_running=3, max_queued=2, batch=True)
    _, odd = collect(sched, 777, 8)
    _, good = collect(sched, 5, 6)
    sched.start()
    try:
        odd_updates, updates = drain(odd), drain(good)
    finally:
        sched.stop(timeout=5)
    # Every failed batch was redone one session at a time: nothing lost, nothing doubled.
    assert [i for u in odd_updates for i in u.new_ids] == [777000 + i for i in range(8)]
    assert [i for u in updates for i in u.new_ids] == [5000 + i for i in range(6)]
    assert updates[-1].finish_reason == odd_updates[-1].finish_reason == "length"
    assert [5, 777] in engine.batches and sched.stats.batched_rounds_total == 0
    assert not engine.open_sessions


def test_batching_needs_an_engine_with_step_many():
    assert not Scheduler(FakeEngine(), batch=True).batch
    assert Scheduler(BatchingEngine(), batch=True).batch
    assert not Scheduler(BatchingEngine()).batch


def test_engine_thread_runs_calls_in_order_on_one_thread_and_raises_their_errors():
    worker = EngineThread("test-engine")
    seen = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
    for f in futures:
        f.result(timeout=5)
    assert [i for i, _ in seen] == list(range(5))
    assert {ident for _, ident in seen} == {worker.ident} and worker.ident != threading.get_ident()
    with pytest.raises(EngineError, match="bad model"):
        worker.call(lambda: (_ for _ in ()).throw(EngineError("bad model")))
    assert worker.call(lambda: 41 + 1) == 42  # a failed call leaves the thread serving


def test_rounds_run_on_the_thread_that_loaded_the_engine():
    """The server loads and warms up on an EngineThread and hands it to the scheduler: one thread
    touches the engine from start to end (one OpenMP pool; see EngineThread)."""
    worker = EngineThread("test-engine")
    engine = worker.call(FakeEngine)
    sched = Scheduler(engine, max_running=2, max_queued=2, thread=worker)
    sched.start()
    try:
        _, q = collect(sched, 1, 6)
        drain(q)
    finally:
        sched.stop(timeout=5)
    assert engine.step_threads == {worker.ident}
    # The loop has returned: the thread takes further calls (nothing else is left on it).
    assert worker.call(threading.get_ident) == worker.ident


def test_a_new_sessions_first_token_is_published_before_the_running_round():
    """on_publish (the engine process's send) fires between a turn's prefills and its batched
    round, so a first token leaves without waiting for the running sessions' round."""
    engine = BatchingEngine()
    events: list = []
    queues = {tag: queue.Queue() for tag in (1, 2, 3)}

    def sink(tag):
        def put(update):
            events.append((tag, update.turn))
            queues[tag].put(update)
        return put

    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True, on_publish=lambda: events.append("publish"))
    for tag in (1, 2):
        sched.submit([tag], Gen(40), Spec(), sink(tag))

    def join_while_running(session):  # on the engine thread: 1 and 2 are mid-generation
        if session.tag == 1 and len(session.output_ids) == 4:
            sched.submit([3], Gen(4), Spec(), sink(3))

    engine.after_step = join_while_running
    sched.start()
    try:
        drain(queues[3], timeout=30)
        for tag in (1, 2):
            drain(queues[tag], timeout=30)
    finally:
        sched.stop(timeout=5)
    first = next(i for i, e in enumerate(events) if e != "publish" and e[0] == 3)
    turn = events[first][1]
    others = [i for i, e in enumerate(events) if e != "publish" and e[0] in (1, 2) and e[1] == turn]
    assert others and "publish" in events[first + 1:others[0]]


@pytest.mark.parametrize("batch", [False, True])
def test_stream_interval_gathers_tokens_but_sends_the_first_and_the_end_at_once(batch):
    """FakeSession commits 2 tokens a round, so with an interval of 5 the updates hold 2 (the
    first round, at once), then 6 (three rounds gathered, since 4 < 5), ..., and the rest at the
    end; every token arrives once, in order, and the rounds' taus with them."""
    engine = BatchingEngine() if batch else FakeEngine()
    sched = Scheduler(engine, max_running=2, max_queued=2, batch=batch, stream_interval=5)
    _, q1 = collect(sched, 1, 17)
    _, q2 = collect(sched, 2, 3)
    sched.start()
    try:
        long, short = drain(q1), drain(q2)
    finally:
        sched.stop(timeout=5)
    assert [len(u.new_ids) for u in long] == [2, 6, 6, 3]
    assert [i for u in long for i in u.new_ids] == [1000 + i for i in range(17)]
    assert [a for u in long for a in u.new_accepts] == [2] * 8 + [1]
    assert long[-1].done and long[-1].finish_reason == "length" and not any(u.done for u in long[:-1])
    assert [len(u.new_ids) for u in short] == [2, 1] and short[-1].done
    assert sched.stats.generation_tokens_total == 20


@pytest.mark.parametrize("batch", [False, True])
def test_the_counters_hold_every_token_sent_whenever_updates_leave_and_before_an_end(batch):
    """Tokens are booked once per publish point, not once per request and turn: whenever a turn's
    updates leave (on_publish), the counters hold every token sent so far, and a request's own
    tokens are in them before its final update is sent."""
    engine = BatchingEngine() if batch else FakeEngine()
    sent, at_publish, at_end = [0], [], []
    sched = Scheduler(engine, max_running=3, max_queued=2, batch=batch,
                      on_publish=lambda: at_publish.append((sched.stats.generation_tokens_total, sent[0])))
    queues = []

    def sink(q):
        def put(update):  # on the engine thread, as every sink
            sent[0] += len(update.new_ids)
            if update.done:
                at_end.append((sched.stats.generation_tokens_total, sent[0]))
            q.put(update)
        return put

    for tag, n in ((1, 9), (2, 4), (3, 13)):
        queues.append(queue.Queue())
        sched.submit([tag], Gen(n), Spec(), sink(queues[-1]))
    run_all(sched, queues)
    assert at_publish and all(booked == total for booked, total in at_publish)
    assert len(at_end) == 3 and all(booked >= total for booked, total in at_end)
    assert sched.stats.generation_tokens_total == 26


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_stream_interval_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="stream_interval"):
        Scheduler(FakeEngine(), stream_interval=bad)


def test_a_ticket_that_may_not_hold_gets_every_round_at_once():
    """A request with stop strings (hold=False) sees each round's tokens as they are committed,
    whatever the interval: its consumer matches the stop, so held tokens would be decoded past it."""
    engine = FakeEngine()
    sched = Scheduler(engine, max_running=2, stream_interval=5)
    q = queue.Queue()
    sched.submit([1], Gen(7), Spec(), q.put, hold=False)
    sched.start()
    try:
        updates = drain(q)
    finally:
        sched.stop(timeout=5)
    assert [len(u.new_ids) for u in updates] == [2, 2, 2, 1]


def test_tokens_held_for_the_interval_are_counted_when_the_request_is_cancelled():
    """The counters see every committed token and round by the end of its turn, not when it is
    sent, so a request dropped while its tokens wait for the interval still counts them (as with
    an interval of 1)."""
    engine = FakeEngine()
    sched = Scheduler(engine, max_running=2, stream_interval=100)
    tickets = []

    def cancel_after_three_rounds(session):
        if len(session.output_ids) == 6:
            tickets[0].cancel()

    engine.after_step = cancel_after_three_rounds
    q = queue.Queue()
    tickets.append(sched.submit([5], Gen(50), Spec(), q.put))
    sched.start()
    try:
        updates = drain(q)
    finally:
        sched.stop(timeout=5)
    assert [len(u.new_ids) for u in updates] == [2, 0] and updates[-1].finish_reason == "abort"
    assert sched.stats.generation_tokens_total == 6 and sched.stats.verify_calls_total == 3


def test_on_idle_runs_after_the_last_update_once_nothing_runs_or_waits():
    """The engine process holds updates back for the GPU's next wait; when the work runs out
    there is no next wait, so on_idle (which sends them) must come after the last update."""
    engine = BatchingEngine()
    events: list = []
    done = threading.Event()

    def sink(update):
        events.append(("update", update.done))

    def idle():
        events.append("idle")
        if any(e == ("update", True) for e in events):
            done.set()

    sched = Scheduler(engine, max_running=4, max_queued=4, batch=True, on_idle=idle)
    sched.submit([1], Gen(5), Spec(), sink)
    sched.start()
    try:
        assert done.wait(60)
    finally:
        sched.stop(timeout=5)
    last = max(i for i, e in enumerate(events) if e != "idle")
    assert events[last] == ("update", True) and "idle" in events[last + 1:]
