"""The engine process's outbox (engine_loop._Outbox): its sender thread (an engine on a GPU) keeps the order things were
queued in, sends turns that queued up behind a slow send as one message, and goes on after a
message it cannot pickle. A real socket pair; the test reads the HTTP process's end."""

from __future__ import annotations

import logging
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from ddtree.engine.reference.engine_loop import _Outbox
from ddtree.engine.errors import EngineError
from ddtree.engine.reference.scheduler import Ticket, Update


@pytest.fixture
def ends():
    ours, theirs = socket.socketpair()
    # Small buffers whatever the host's defaults, so an 8 MiB message never fits: its send
    # waits for the reader, which the tests below rely on.
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    outbox = _Outbox(Connection(ours.detach()))
    reader = Connection(theirs.detach())
    yield outbox, reader
    outbox.conn.close()
    reader.close()


def ticket(turn: int) -> Ticket:
    t = Ticket([1, 2], None, None, None)
    t.submitted_turn = turn
    return t


def test_updates_and_messages_leave_in_the_order_they_were_queued(ends):
    outbox, reader = ends
    outbox.put(1, ticket(3), Update((5,), (1,), 1))
    outbox.flush()
    outbox.put(2, ticket(4), Update((6, 7), (2,), 1, done=True, finish_reason="length"))
    outbox.send(("snapshot", 9, "s"))  # behind the update put before it, though not flushed
    outbox.flush()  # nothing left to flush: sends nothing
    outbox.send(("stopped",))
    assert outbox.drain(30)
    got = []
    while not got or got[-1] != ("stopped",):
        got.append(reader.recv())
    # The two turns may leave as one message (the second queued before the first was sent).
    first = [m for m in got[:got.index(("snapshot", 9, "s"))]]
    assert all(m[0] == "updates" for m in first)
    assert [item for m in first for item in m[1]] == [
        (1, 3, tuple(Update((5,), (1,), 1))),
        (2, 4, tuple(Update((6, 7), (2,), 1, done=True, finish_reason="length")))]
    assert got[len(first):] == [("snapshot", 9, "s"), ("stopped",)]
    assert not reader.poll(0.2)  # and nothing else came


def test_turns_queued_behind_a_send_in_flight_leave_as_one_message(ends):
    outbox, reader = ends
    big = ("snapshot", 0, b"x" * (8 << 20))  # more than the socket holds: its send waits for the reader
    outbox.send(big)
    for turn in range(3):
        outbox.put(turn, ticket(turn), Update((turn,), (), 0))
        outbox.flush()
    assert reader.recv() == big
    assert reader.recv() == ("updates", [(turn, turn, tuple(Update((turn,), (), 0))) for turn in range(3)])
    assert outbox.drain(30)
    assert not reader.poll(0.2)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not this one")


def test_a_message_that_cannot_be_pickled_is_logged_and_the_rest_still_leave(ends, caplog):
    outbox, reader = ends
    with caplog.at_level(logging.ERROR, logger="ddtree.engine.reference.engine_loop"):
        outbox.send(("snapshot", 1, Unpicklable()))
        outbox.send(("stopped",))
        assert outbox.drain(30)
    assert reader.recv() == ("stopped",)
    assert any("sending snapshot" in r.getMessage() for r in caplog.records)


def test_drain_waits_for_a_send_in_flight_and_reports_a_timeout(ends):
    outbox, reader = ends
    outbox.send(("snapshot", 0, b"x" * (8 << 20)))
    assert not outbox.drain(0.2)  # nobody reads yet, so the send cannot finish
    got = []
    t = threading.Thread(target=lambda: got.append(reader.recv()))
    t.start()
    assert outbox.drain(30)
    t.join(30)
    assert got and got[0][1] == 0


class OddError(EngineError):
    """An engine error carrying something pickle refuses."""

    def __init__(self) -> None:
        super().__init__("odd")
        self.hook = lambda: None


def test_an_update_that_cannot_be_pickled_ends_its_request_and_loses_no_other(ends, caplog):
    outbox, reader = ends
    big = ("snapshot", 0, b"x" * (8 << 20))
    outbox.send(big)  # holds the sender, so the two turns below leave as one message
    outbox.put(1, ticket(1), Update((5,), (1,), 1, done=True, finish_reason="length"))
    outbox.flush()
    outbox.put(2, ticket(1), Update(done=True, finish_reason="abort", error=OddError()))
    outbox.put(3, ticket(1), Update((6,), (1,), 1))
    outbox.send(("stopped",))
    with caplog.at_level(logging.ERROR, logger="ddtree.engine.reference.engine_loop"):
        assert reader.recv() == big
        got = []
        while not got or got[-1] != ("stopped",):
            got.append(reader.recv())
        assert outbox.drain(30)
    items = [item for m in got[:-1] for item in m[1]]
    assert [(tid, fields[3], fields[4]) for tid, _, fields in items] == [
        (1, True, "length"), (2, True, "abort"), (3, False, None)]
    assert "could not be pickled" in str(items[1][2][5])
    assert any("sending updates" in r.getMessage() for r in caplog.records)


def test_the_queue_holds_at_most_max_queued_messages_then_the_engine_waits(ends):
    outbox, reader = ends
    outbox.send(("snapshot", 0, b"x" * (8 << 20)))  # nobody reads yet: the sender waits on it
    for _ in range(3000):  # until the sender has taken it (a poll; nothing asserted on time)
        if outbox._queue.qsize() == 0:
            break
        threading.Event().wait(0.01)
    assert outbox._queue.qsize() == 0
    for turn in range(_Outbox.MAX_QUEUED):  # fills the queue, none of them waits
        outbox.put(turn, ticket(turn), Update((turn,), (), 0))
        outbox.flush()
    assert not outbox._room.acquire(blocking=False)  # the next flush would wait for the sender
    assert reader.recv()[1] == 0
    outbox.send(("stopped",))
    got = []
    while not got or got[-1] != ("stopped",):
        got.append(reader.recv())
    assert [item[0] for m in got[:-1] for item in m[1]] == list(range(_Outbox.MAX_QUEUED))
    assert outbox.drain(30) and outbox._room.acquire(blocking=False)  # the room came back


def test_without_a_thread_the_caller_writes_in_order_and_an_odd_update_ends_only_its_request(caplog):
    """An engine on the CPU: flush and send write at once, on the caller's thread, with the same
    fallback for an update that cannot be pickled."""
    ours, theirs = socket.socketpair()
    outbox, reader = _Outbox(Connection(ours.detach()), "inline"), Connection(theirs.detach())
    try:
        outbox.put(1, ticket(1), Update((5,), (1,), 1))
        outbox.flush()
        assert reader.poll(0) and reader.recv() == ("updates", [(1, 1, tuple(Update((5,), (1,), 1)))])
        outbox.put(2, ticket(2), Update(done=True, finish_reason="abort", error=OddError()))
        outbox.put(3, ticket(2), Update((6,), (1,), 1))
        with caplog.at_level(logging.ERROR, logger="ddtree.engine.reference.engine_loop"):
            outbox.send(("stopped",))
        assert outbox.drain(0)
        got = []
        while not got or got[-1] != ("stopped",):
            got.append(reader.recv())
        items = [item for m in got[:-1] for item in m[1]]
        assert [(tid, fields[3], fields[4]) for tid, _, fields in items] == [(2, True, "abort"), (3, False, None)]
    finally:
        outbox.conn.close()
        reader.close()


def test_wait_mode_holds_a_turns_updates_for_the_engines_push_and_keeps_the_order(monkeypatch):
    """An engine on a GPU: flush holds the updates, push (the engine, right before it waits for
    the GPU) writes them on its own thread; a message from another thread takes what is held
    first; updates held past HOLD_S go at the next flush. No thread of its own."""
    ours, theirs = socket.socketpair()
    threads = set(threading.enumerate())
    outbox, reader = _Outbox(Connection(ours.detach()), "wait"), Connection(theirs.detach())
    monkeypatch.setattr(_Outbox, "HOLD_S", 3600.0)  # held until pushed, whatever the machine's pace
    try:
        assert set(threading.enumerate()) <= threads
        outbox.put(1, ticket(1), Update((5,), (1,), 1))
        outbox.flush()
        outbox.put(2, ticket(1), Update((6,), (1,), 1))
        outbox.flush()
        assert not reader.poll(0)  # held
        outbox.push()  # both turns' updates, in one message
        assert reader.recv() == ("updates", [(1, 1, tuple(Update((5,), (1,), 1))),
                                             (2, 1, tuple(Update((6,), (1,), 1)))])
        outbox.put(3, ticket(2), Update((7,), (1,), 1))
        outbox.flush()
        sender = threading.Thread(target=outbox.send, args=(("snapshot", 4, "s"),))
        sender.start()
        sender.join()
        assert reader.recv() == ("updates", [(3, 2, tuple(Update((7,), (1,), 1)))])
        assert reader.recv() == ("snapshot", 4, "s")
        monkeypatch.setattr(_Outbox, "HOLD_S", 0.0)  # a turn without a GPU wait: flush writes
        outbox.put(5, ticket(3), Update((8,), (1,), 1))
        outbox.flush()
        assert reader.recv() == ("updates", [(5, 3, tuple(Update((8,), (1,), 1)))])
        assert outbox.drain(0) and not reader.poll(0.2)
    finally:
        outbox.conn.close()
        reader.close()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="wait, thread or inline"):
        _Outbox(None, "later")
