"""The engine process's outbox (engine_loop._Outbox): its sender thread keeps the order things were
queued in, sends turns that queued up behind a slow send as one message, and goes on after a
message it cannot pickle. A real socket pair; the test reads the HTTP process's end."""

from __future__ import annotations

import logging
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from ddtree.engine.reference.engine_loop import _Outbox
from ddtree.engine.reference.scheduler import Ticket, Update


@pytest.fixture
def ends():
    ours, theirs = socket.socketpair()
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
