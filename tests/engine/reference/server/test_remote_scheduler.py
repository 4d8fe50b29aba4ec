"""RemoteScheduler, the HTTP side of the engine process (engine_loop.py), against a scripted
engine end of a real socket pair: what it does with late answers, unknown tickets, a full queue
and an engine that goes away. No torch, no engine: the other end of the socket is this test."""

from __future__ import annotations

import queue
import socket
import threading
from concurrent.futures import CancelledError
from multiprocessing.connection import Connection

import pytest

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.engine_loop import RemoteScheduler
from ddtree.engine.reference.scheduler import QueueFull, ShuttingDown, Snapshot, Stats, Update


class Exited:
    """A process that has already exited: what RemoteScheduler waits on and reports."""

    returncode = -9

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        pass


class Failures(list):
    """What on_failure was told. The reader fails the held tickets before it calls on_failure,
    so a test that has seen a ticket's error waits here for the call rather than race it."""

    def __init__(self) -> None:
        super().__init__()
        self.called = threading.Event()

    def append(self, why: str) -> None:
        super().append(why)
        self.called.set()

    def wait(self) -> list[str]:
        assert self.called.wait(timeout=30), "on_failure was never called"
        return list(self)


def connect(process) -> tuple[RemoteScheduler, Connection, Failures]:
    """A started RemoteScheduler on `process`, the engine's end of its socket, and its failures."""
    ours, theirs = socket.socketpair()
    failures = Failures()
    sched = RemoteScheduler(process, Connection(ours.detach()), max_running=1, max_queued=1,
                            on_failure=failures.append)
    sched.start()
    return sched, Connection(theirs.detach()), failures


@pytest.fixture
def pair():
    sched, engine, failures = connect(Exited())
    yield sched, engine, failures
    engine.close()


def submit(sched) -> tuple[object, queue.Queue]:
    got: queue.Queue = queue.Queue()
    return sched.submit([1, 2], "gen", "spec", got.put), got


def snapshot(turns: int = 0) -> Snapshot:
    return Snapshot(Stats().view(0.0), running=turns, queued=0, pool=None)


def test_updates_reach_their_ticket_and_a_late_answer_to_a_dropped_poll_is_ignored(pair):
    sched, engine, _ = pair
    sched.stats.observe_ttft(0.5)
    poll = sched.snapshot(0.0)
    # This side's TTFT and ITL go first, on the same socket, so the engine's sum has them.
    observed = engine.recv()
    assert observed[0] == "observed" and observed[1].count == 1 and observed[2].count == 0
    assert engine.recv()[0] == "snapshot"
    poll.cancel()  # the /metrics poll timed out, or its client left
    ticket, got = submit(sched)
    assert engine.recv() == ("submit", ticket.tid, [1, 2], "gen", "spec", True)
    engine.send(("snapshot", 0, snapshot()))  # the late answer to the cancelled poll
    engine.send(("updates", [(999, 0, Update(new_ids=(7,))),  # a ticket nobody holds
                             (ticket.tid, 3, Update(new_ids=(5,))), (ticket.tid, 3, Update(new_ids=(6,), done=True))]))
    assert [got.get(timeout=30).new_ids, got.get(timeout=30).new_ids] == [(5,), (6,)]
    assert ticket.submitted_turn == 3 and ticket.finished
    answer = sched.snapshot(0.0)  # the reader is alive and answers the next poll
    assert engine.recv()[0] == "observed"
    _, qid = engine.recv()
    engine.send(("snapshot", qid, snapshot(turns=2)))
    assert answer.result(timeout=30).running == 2
    with pytest.raises(CancelledError):
        poll.result(timeout=0)


def test_the_queue_cap_counts_requests_until_their_final_update_and_cancel_after_it_sends_nothing(pair):
    sched, engine, _ = pair
    first, got = submit(sched)
    second, _ = submit(sched)
    with pytest.raises(QueueFull):
        submit(sched)
    engine.send(("updates", [(first.tid, 0, Update(new_ids=(4,), done=True))]))
    assert got.get(timeout=30).done
    first.cancel()  # after the end: nothing goes to the engine
    third, _ = submit(sched)  # the finished one's place is free again
    second.cancel()
    messages = [engine.recv()[0] for _ in range(4)]
    assert messages == ["submit", "submit", "submit", "cancel"]


def test_an_engine_that_dies_fails_what_it_held_and_says_why_once(pair):
    sched, engine, failures = pair
    _, got = submit(sched)
    poll = sched.snapshot(0.0)
    engine.send(("dead", "the engine loop failed: RuntimeError: boom"))
    engine.close()
    final = got.get(timeout=30)
    assert final.done and isinstance(final.error, EngineError) and "boom" in str(final.error)
    with pytest.raises(ShuttingDown):
        poll.result(timeout=30)
    assert failures.wait() == ["the engine loop failed: RuntimeError: boom"]
    assert sched.failure == failures[0]
    with pytest.raises(ShuttingDown, match="boom"):
        submit(sched)
    with pytest.raises(ShuttingDown):
        sched.snapshot(0.0).result(timeout=0)


def test_an_engine_that_exits_without_a_word_is_reported_with_its_exit_code(pair):
    sched, engine, failures = pair
    _, got = submit(sched)
    engine.close()
    assert "exit code -9" in str(got.get(timeout=30).error)
    assert failures.wait() == ["the engine process exited (exit code -9)"]


class Picky(EngineError):
    """Pickles, but unpickling calls __init__ with one of its two arguments."""

    def __init__(self, message, extra):
        super().__init__(message)


class Running(Exited):
    """A process that has not exited: the engine still runs after sending what cannot be read."""

    returncode = None

    def wait(self, timeout=None):
        raise AssertionError("nothing should wait for an engine that is still running")


def test_a_message_that_cannot_be_read_fails_what_was_held_and_the_server_at_once():
    sched, engine, failures = connect(Running())
    try:
        _, got = submit(sched)
        engine.send(("updates", [(0, 0, tuple(Update(done=True, finish_reason="abort", error=Picky("odd", 1))))]))
        final = got.get(timeout=30)
        assert final.done and "could not be read" in str(final.error)
        assert len(failures.wait()) == 1 and "TypeError" in failures[0]
    finally:
        engine.close()
