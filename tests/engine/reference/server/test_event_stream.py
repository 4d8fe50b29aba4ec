"""_EventStream's own stream/listener pair (in place of Starlette's anyio task group): a stream
that ends stops the listener, a client that leaves stops the stream, and errors and cancels of the
serving task still reach it."""

from __future__ import annotations

import asyncio

import pytest

from ddtree.engine.reference.server import _EventStream

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


class Client:
    """An ASGI receive that says http.disconnect once `leave` is set, and a send that records."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.sent: list[dict] = []
        self.sent_one = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        self.sent_one.set()


def bodies(client: Client) -> list[bytes]:
    return [m["body"] for m in client.sent if m["type"] == "http.response.body"]


def others() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def test_a_stream_that_ends_stops_its_listener():
    async def main():
        closed = []

        async def chunks():
            yield b"a"
            yield b"b"

        client = Client()
        await _EventStream(chunks(), lambda: closed.append(1))(SCOPE, client.receive, client.send)
        await asyncio.sleep(0)
        return client, closed, others()

    client, closed, left = asyncio.run(main())
    assert bodies(client) == [b"a", b"b", b""]
    assert closed == [1]
    assert left == set()


async def stalled_stream(client: Client, closed: list) -> asyncio.Task:
    """A stream that has sent its first chunk and waits for an update that never comes."""
    never = asyncio.Event()

    async def chunks():
        yield b"a"
        await never.wait()  # the engine has nothing more yet
        yield b"b"

    serving = asyncio.create_task(_EventStream(chunks(), lambda: closed.append(1))(
        SCOPE, client.receive, client.send))
    while not bodies(client):
        await client.sent_one.wait()
        client.sent_one.clear()
    return serving


async def settled(closed: list) -> tuple[list, set]:
    """One loop turn later: the request's releases, and the tasks still running besides this one."""
    await asyncio.sleep(0)
    return closed, others()


def assert_released(closed: list, left: set) -> None:
    assert closed == [1]  # released once
    assert left == set()  # no task of the stream left behind


def test_a_client_that_leaves_stops_the_stream_and_releases_it():
    async def main():
        client, closed = Client(), []
        serving = await stalled_stream(client, closed)
        client.leave.set()
        await serving  # returns: a client leaving is no error
        return client, await settled(closed)

    client, released = asyncio.run(main())
    assert bodies(client) == [b"a"]
    assert_released(*released)


def test_an_error_in_the_body_reaches_the_server():
    async def main():
        closed = []

        async def chunks():
            yield b"a"
            raise RuntimeError("boom")

        client = Client()
        with pytest.raises(RuntimeError, match="boom"):
            await _EventStream(chunks(), lambda: closed.append(1))(SCOPE, client.receive, client.send)
        return await settled(closed)

    assert_released(*asyncio.run(main()))


def test_the_chunk_with_done_ends_the_body_in_the_same_send():
    from ddtree.engine.reference.server import SSE_DONE

    async def main():
        async def chunks():
            yield b"data: 1\n\n"
            yield b"data: 2\n\n" + SSE_DONE

        client = Client()
        await _EventStream(chunks(), lambda: None)(SCOPE, client.receive, client.send)
        return client

    client = asyncio.run(main())
    body = [(m["body"], m["more_body"]) for m in client.sent if m["type"] == "http.response.body"]
    assert body == [(b"data: 1\n\n", True), (b"data: 2\n\n" + SSE_DONE, False)]


@pytest.mark.parametrize("leaves", ["never", "before", "after"])
def test_cancelling_the_serving_task_cancels_the_stream(leaves):
    # Also with the client leaving in the same loop turn as a shutdown's cancel: the cancel must
    # still reach whoever cancelled (Starlette's own __call__ keeps it too).
    async def main():
        client, closed = Client(), []
        serving = await stalled_stream(client, closed)
        if leaves == "before":
            client.leave.set()
        serving.cancel()
        if leaves == "after":
            client.leave.set()
        with pytest.raises(asyncio.CancelledError):
            await serving
        return await settled(closed)

    assert_released(*asyncio.run(main()))


def test_an_error_in_receive_reaches_the_server():
    async def main():
        client, closed = Client(), []
        broken = asyncio.Event()

        async def receive() -> dict:
            await broken.wait()
            raise RuntimeError("receive failed")

        client.receive = receive
        serving = await stalled_stream(client, closed)
        broken.set()
        with pytest.raises(RuntimeError, match="receive failed"):
            await serving
        return await settled(closed)

    assert_released(*asyncio.run(main()))
