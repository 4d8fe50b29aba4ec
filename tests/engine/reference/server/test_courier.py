"""Updates from the engine thread reach the event loop in bursts (api.Courier) and a stream that
fell behind catches up in one merged update (api._merged)."""

from __future__ import annotations

import asyncio
import threading

from ddtree.engine.reference.api import Courier, _merged
from ddtree.engine.reference.scheduler import Update


def test_queued_updates_merge_up_to_the_last_one():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for update in (Update(new_ids=(1,), new_accepts=(1,), verify_ct=1),
                       Update(new_ids=(2, 3), new_accepts=(2,), verify_ct=2),
                       Update(new_ids=(4,), new_accepts=(1,), verify_ct=3, done=True, finish_reason="length"),
                       Update(new_ids=(9,))):
            queue.put_nowait(update)
        merged = _merged(await queue.get(), queue)
        return merged, queue.qsize()
    merged, left = asyncio.run(run())
    assert merged.new_ids == (1, 2, 3, 4) and merged.new_accepts == (1, 2, 1)
    assert merged.verify_ct == 3 and merged.done and merged.finish_reason == "length"
    assert left == 1  # nothing past the final update is taken


def test_an_update_alone_is_returned_as_is():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        first = Update(new_ids=(5,))
        return first, _merged(first, queue)
    first, merged = asyncio.run(run())
    assert merged is first


def test_the_courier_delivers_every_update_in_order_from_another_thread():
    async def run():
        loop = asyncio.get_running_loop()
        courier = Courier(loop)
        queues = [asyncio.Queue() for _ in range(3)]

        def engine():
            for i in range(200):
                courier.put(queues[i % 3], Update(new_ids=(i,)))
        thread = threading.Thread(target=engine)
        thread.start()
        got = [[] for _ in queues]
        for _ in range(1_000_000):  # counted, so a lost update fails instead of hanging
            if sum(len(g) for g in got) == 200:
                break
            for q, g in zip(queues, got):
                while not q.empty():
                    g.append(q.get_nowait().new_ids[0])
            await asyncio.sleep(0)
        thread.join()
        return got
    got = asyncio.run(run())
    assert got == [list(range(k, 200, 3)) for k in range(3)]
