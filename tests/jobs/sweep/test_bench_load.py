"""The bench client's load shape against a small streaming server of our own (no model): the
concurrency cap, kept-alive connections, request-rate arrivals and stopping a point early."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest

from ddtree.engine.serving.bench import BenchConfig, run_point
from ddtree.engine.serving.prompts import Prompt

pytestmark = pytest.mark.timeout(60)

uvicorn = pytest.importorskip("uvicorn")
starlette_apps = pytest.importorskip("starlette.applications")


class SlowServer:
    """Streams `chunks` SSE chunks `delay` seconds apart; records requests in flight and peers."""

    def __init__(self, chunks: int = 4, delay: float = 0.02, on_request=None) -> None:
        """on_request(n) runs as the n-th request (from 1) arrives."""
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.in_flight = self.max_in_flight = self.requests = 0
        self.peers: set[tuple] = set()
        self.lock = threading.Lock()

        async def generate(request):
            await request.json()
            with self.lock:
                self.peers.add(request.client)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                self.requests += 1
                n = self.requests
            if on_request is not None:
                on_request(n)

            async def body():
                try:
                    for i in range(1, chunks + 1):
                        await asyncio.sleep(delay)
                        meta = {"prompt_tokens": 3, "completion_tokens": i, "spec_verify_ct": i}
                        yield b"data: " + json.dumps({"text": "x" * i, "meta_info": meta}).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                finally:
                    with self.lock:
                        self.in_flight -= 1

            return StreamingResponse(body(), media_type="text/event-stream")

        app = starlette_apps.Starlette(routes=[Route("/generate", generate, methods=["POST"])])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def slow_server():
    server = SlowServer()
    yield server
    server.close()


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}") for i in range(n)]


def test_concurrency_is_reached_never_passed_and_connections_are_kept(slow_server):
    result = run_point(slow_server.url, prompts(12), BenchConfig(concurrency=3, max_new_tokens=4))
    assert result.metrics["requests_ok"] == 12
    assert slow_server.max_in_flight == 3
    # Each slot reads its response to the end, so its connection goes back to the pool.
    assert len(slow_server.peers) == 3


def test_request_rate_spaces_arrivals_at_least_as_drawn(slow_server):
    cfg = BenchConfig(concurrency=8, max_new_tokens=4, request_rate=40.0, seed=7)
    result = run_point(slow_server.url, prompts(8), cfg)
    assert result.metrics["requests_ok"] == 8
    rng, due, schedule = random.Random(7), 0.0, [0.0]
    for _ in range(7):
        due += rng.expovariate(40.0)
        schedule.append(due)
    starts = [r.start_offset_s for r in result.requests]
    assert all(start >= planned - 1e-3 for start, planned in zip(starts, schedule))


def test_a_stop_event_ends_the_point_early_without_an_error():
    """Stopped as the third request arrives (two at a time: one has ended by then), the point
    keeps what ended and starts nothing more. No clock: the stop follows the server's count."""
    stop = threading.Event()
    server = SlowServer(chunks=5, delay=0.05, on_request=lambda n: n == 3 and stop.set())
    try:
        result = run_point(server.url, prompts(40), BenchConfig(concurrency=2, max_new_tokens=5), stop=stop)
    finally:
        server.close()
    assert 1 <= len(result.requests) <= 3 and all(r.ok for r in result.requests)
    assert server.requests <= 4  # the two in flight when it stopped, and none after
