"""RemoteScheduler, the HTTP side of the engine process (engine_loop.py), against a scripted
engine end of a real socket pair: what it does with late answers, unknown tickets, a full queue
and an engine that goes away. No torch, no engine: the other end of the socket is this test."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import queue
import socket
import struct
import threading
from concurrent.futures import CancelledError
from multiprocessing.connection import Connection

import pytest

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.engine_loop import RemoteScheduler, _Frames
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


@contextlib.contextmanager
def running_loop():
    """An event loop on a thread of its own (the server's is its main thread)."""
    loop = asyncio.new_event_loop()
    runs = threading.Thread(target=loop.run_forever, daemon=True)
    runs.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runs.join(30)
        loop.close()


@pytest.fixture(params=["loop", "thread"])
def reader(request):
    """Where the scheduler reads the engine: on an event loop, as the server starts it, or on its
    reader thread (None)."""
    if request.param == "thread":
        yield None
        return
    with running_loop() as loop:
        yield loop


def connect(process, loop=None) -> tuple[RemoteScheduler, Connection, Failures]:
    """A started RemoteScheduler on `process` (started on `loop` if given), the engine's end of
    its socket, and its failures."""
    ours, theirs = socket.socketpair()
    failures = Failures()
    sched = RemoteScheduler(process, Connection(ours.detach()), max_running=1, max_queued=1,
                            on_failure=failures.append)
    if loop is None:
        sched.start()
    else:
        async def start() -> None:
            sched.start()

        asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
        assert sched._loop is loop
    return sched, Connection(theirs.detach()), failures


@pytest.fixture
def pair(reader):
    sched, engine, failures = connect(Exited(), reader)
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


def test_a_message_that_cannot_be_read_fails_what_was_held_and_the_server_at_once(reader):
    sched, engine, failures = connect(Running(), reader)
    try:
        _, got = submit(sched)
        engine.send(("updates", [(0, 0, tuple(Update(done=True, finish_reason="abort", error=Picky("odd", 1))))]))
        final = got.get(timeout=30)
        assert final.done and "could not be read" in str(final.error)
        assert len(failures.wait()) == 1 and "TypeError" in failures[0]
    finally:
        engine.close()


def test_frames_are_cut_from_bytes_that_arrive_one_at_a_time():
    ours, theirs = socket.socketpair()
    sender, raw = Connection(ours.detach()), theirs
    messages = [("updates", [(0, 1, (5,))]), ("snapshot", 3, "x" * 20000), ("stopped",)]
    for message in messages:
        sender.send(message)
    sender.close()
    data = b""
    while chunk := raw.recv(65536):
        data += chunk
    raw.close()
    frames, got = _Frames(), []
    for i in range(len(data)):
        frames.feed(data[i:i + 1])
        while (payload := frames.pop()) is not None:
            got.append(pickle.loads(payload))
    assert got == messages
    # Past 2 GiB a message's length is -1 and then 8 bytes (multiprocessing.connection).
    body = pickle.dumps(("stopped",))
    frames.feed(struct.pack("!i", -1) + struct.pack("!Q", len(body))[:5])
    assert frames.pop() is None
    frames.feed(struct.pack("!Q", len(body))[5:] + body)
    assert pickle.loads(frames.pop()) == ("stopped",) and frames.pop() is None


def test_stop_on_the_loop_delivers_a_large_update_sent_before_stopped():
    with running_loop() as loop:
        stop_on_the_loop(loop)


def stop_on_the_loop(reader) -> None:
    sched, engine, _ = connect(Exited(), reader)
    ticket, got = submit(sched)
    assert engine.recv()[0] == "submit"
    big = tuple(range(300_000))  # over a megabyte pickled: several reads

    def engine_side() -> None:
        assert engine.recv()[0] == "stop"
        engine.send(("updates", [(ticket.tid, 0, tuple(Update(new_ids=big, done=True)))]))
        engine.send(("stopped",))

    answering = threading.Thread(target=engine_side, daemon=True)
    answering.start()

    async def stop() -> None:
        sched.stop(30)

    asyncio.run_coroutine_threadsafe(stop(), reader).result(timeout=60)
    answering.join(30)
    final = got.get(timeout=30)
    assert final.done and final.new_ids == big and ticket.finished
    assert sched._sock.fileno() == -1  # its duplicate descriptor is closed; the connection's is not
    assert not engine.closed
    engine.close()


def test_a_stop_the_engine_never_answers_fails_what_was_held_once_its_time_is_up():
    with running_loop() as loop:
        sched, engine, failures = connect(Running(), loop)
        _, got = submit(sched)
        assert engine.recv()[0] == "submit"

        async def stop() -> None:
            sched.stop(0.0)  # the engine never says "stopped"

        with pytest.raises(AssertionError, match="nothing should wait"):
            # Running.wait raises once stop() moves on to wait for the process: by then what the
            # scheduler held has failed, and no reader is left to leave it hanging.
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
        final = got.get(timeout=0)
        assert final.done and isinstance(final.error, EngineError)
        assert failures == []  # a stop the server asked for is no failure
        engine.close()
