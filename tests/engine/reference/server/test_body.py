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


def test_a_lone_surrogate_is_refused_in_a_body_of_any_encoding_json_takes():
    """json.loads reads UTF-16 and UTF-32 bodies too (surrogatepass): an escaped lone surrogate
    there is as much not text as in UTF-8, and was let through to the tokenizer and the reply."""
    import pytest

    from ddtree.engine.reference.api import BadRequest
    from ddtree.engine.reference.server import _parse_json

    for encoding in ("utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"):
        with pytest.raises(BadRequest, match="lone UTF-16 surrogate"):
            _parse_json('{"text": "a\\ud800b"}'.encode(encoding))
        assert _parse_json('{"text": "x \\ud83d\\ude00"}'.encode(encoding)) == {"text": "x \U0001F600"}
