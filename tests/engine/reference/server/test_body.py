"""Where the server parses a request body (server._off_loop): a short one on the event loop, where
a hop to a worker thread would cost more than the parse; a long one on a worker thread, so it never
stalls /health or the streams."""

from __future__ import annotations

import asyncio
import threading

from ddtree.engine.reference.server import INLINE_BODY_BYTES, _off_loop


def where(size: int) -> bool:
    """Whether _off_loop ran the work for a body of `size` bytes on the event loop's own thread."""
    async def main() -> bool:
        loop_thread = threading.get_ident()
        return await _off_loop(size, threading.get_ident) == loop_thread
    return asyncio.run(main())


def test_a_short_body_is_handled_on_the_loop_and_a_long_one_on_a_worker_thread():
    assert where(0) and where(INLINE_BODY_BYTES)
    assert not where(INLINE_BODY_BYTES + 1)
