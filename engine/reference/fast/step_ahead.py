"""A lone greedy AR session's next step queued before the host reads this one's token.

An AR step on a slot is one graph replay, an argmax and a read of that token. The next step's
input is that argmax, so it can be written into the slot's stage on the device and the next
replay queued right away; the host then reads the token (through a pinned buffer and an event,
so it waits for this step only) while the GPU runs the next one. The next step of the same
session takes that step's argmax instead of launching anything, and queues the one after. So the
GPU no longer idles while the host books a token, streams it and comes back (0.17-0.28 ms a step
on the 8B shape, about a third of the demo pair's step: bench/RESULTS.md). It is the lone
session's form of the pool's rounds run ahead (fast/batch_graph.py), under the same switch
(FastPath.round_ahead, the server's --disable-overlap-schedule).

A step run ahead that nobody takes (the session stopped on that token, reached its length, or
went into a batched round) costs GPU time and nothing else: it wrote the K/V row past the cache's
length, which no query sees and the next step at that position writes again, and the host's
length never counted it. A taken step books that row without writing it again, so nothing else
may write it meanwhile: a batched round on the pool writes past the length of every slot below
its batch as an inactive row, so fast/batch.step_many drops a pending step before any pool work
(drop). Steps run ahead only for a session whose last step was the last one here: sessions
stepping in turn (no batching) would drop every one.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ddtree.engine.reference.fast.cache import StaticKVCache
from ddtree.engine.reference.fast.target import FastTarget


class _InOrder:
    """A CPU's stand-in for the read's event: its work has run by the time it is queued."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class StepAhead:
    def __init__(self, target: FastTarget) -> None:
        self.target = target
        device = target.device
        self._tokens = torch.zeros(2, dtype=torch.long, device=device)  # this step's and the next one's argmax
        cuda = device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.long, pin_memory=cuda)
        self._read = torch.cuda.Event() if cuda else _InOrder()
        # (the session's cache, weakly; the position its step ran at; which of _tokens holds its argmax)
        self.pending: tuple[weakref.ref, int, int] | None = None
        self._last: weakref.ref | None = None  # the cache of the last step here
        self.counts = {"launched": 0, "taken": 0, "dropped": 0}

    def drop(self) -> None:
        """Forget the pending step: something else is about to write past a slot's length."""
        if self.pending is not None:
            self.pending = None
            self.counts["dropped"] += 1

    def step(self, cache: StaticKVCache, bonus: int, again: bool,
             busy: Callable[[], None] = lambda: None) -> int | None:
        """The greedy token after `bonus` at the cache's length, its row booked in the cache.
        again: the session steps once more after this one, so that step may be queued now.
        busy: called once the GPU has its work, right before the host waits for the token.
        None where no static path serves this cache (the caller runs the plain step)."""
        start = cache.length
        again = again and self._last is not None and self._last() is cache
        self._last = weakref.ref(cache)
        pending, self.pending = self.pending, None
        if pending is not None and pending[0]() is cache and pending[1] == start:
            at = pending[2]
            self.counts["taken"] += 1
        else:
            if pending is not None:
                self.counts["dropped"] += 1
            stage = self.target.step_one(cache, bonus)
            if stage is None:
                return None
            at = 0
            torch.argmax(stage.logits[:1], dim=-1, out=self._tokens[at:at + 1])
        cache.set_length(start + 1)
        token = self._tokens[at:at + 1]
        if not again:
            busy()
            return int(token.item())
        self._host.copy_(token, non_blocking=True)
        self._read.record(torch.cuda.current_stream(token.device) if token.is_cuda else None)
        self._ahead(cache, token, 1 - at)
        busy()
        self._read.synchronize()
        return int(self._host.tolist()[0])  # a host read: the sync was the event's

    def _ahead(self, cache: StaticKVCache, token: torch.Tensor, into: int) -> None:
        stage = self.target.step_one(cache, token)
        if stage is None:  # the next position needs a graph this slot does not have
            return
        torch.argmax(stage.logits[:1], dim=-1, out=self._tokens[into:into + 1])
        self.pending = (weakref.ref(cache), cache.length, into)
        self.counts["launched"] += 1
