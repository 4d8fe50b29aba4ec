"""Reply's stop strings: the ids end at the token that completed the stop, however the tokens
arrive, including in a chunk that ends in half a multi-byte character (the decoder holds such a
chunk's text back, so the stop is only seen with the next chunk)."""

from __future__ import annotations

import asyncio

import pytest

from ddtree.engine.reference.api import GenRequest, Reply, stream_decoder
from ddtree.engine.reference.params import GenParams, SpecParams
from ddtree.engine.reference.scheduler import Stats, Update

from .test_incremental_text import demo_tokenizer

pytest.importorskip("tokenizers")

TEXT = "x = 1 STOP 你好 world and more"


class _Ticket:
    submitted_turn = 0

    def __init__(self) -> None:
        self.cancelled = None

    def cancel(self, reason: str = "abort") -> None:
        self.cancelled = reason


class _Scheduler:
    def submit(self, input_ids, gen, spec, sink, *, hold=True):
        self.hold = hold
        return _Ticket()


class _Api:
    """What a Reply reads of its Api: a scheduler, the counters, and the decoders."""

    def __init__(self, tok) -> None:
        self.tok, self.stats, self.scheduler = tok, Stats(), _Scheduler()
        self.stream_decoders = {skip: stream_decoder(tok, skip) for skip in (True, False)}

    def _decode(self, ids, skip=True):
        return self.tok.decode(ids, skip_special_tokens=skip)


def reply_of(tok, ids, chunks, *, stream=True):
    async def go():
        api = _Api(tok)
        reply = Reply(api, GenRequest(input_ids=[1], gen=GenParams(), spec=SpecParams(), stops=("STOP",), stream=stream))
        pos = 0
        for n in chunks:
            if reply.done:
                break
            reply._apply(Update(new_ids=tuple(ids[pos:pos + n]), new_accepts=(n,), verify_ct=1))
            pos += n
        return reply, api
    return asyncio.run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_ids_end_at_the_token_that_completed_the_stop_however_they_arrive(stream):
    tok = demo_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    k = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))
    # A chunk past the stop that ends one byte-token into 你, whose text therefore waits.
    cut = next(j for j in range(k + 1, len(ids) + 1) if tok.decode(ids[:j]).endswith("\ufffd"))
    for chunks in ([1] * len(ids), [cut, len(ids) - cut], [k, len(ids) - k], [len(ids)]):
        reply, api = reply_of(tok, ids, chunks, stream=stream)
        assert reply.done and reply.finish_reason == "stop" and reply.matched == "STOP", chunks
        assert reply.ids == ids[:k], chunks
        assert reply.text == "x = 1 ", chunks
        assert reply.ticket.cancelled == "stop"
        assert api.scheduler.hold is False  # the engine must not hold tokens the stop needs
