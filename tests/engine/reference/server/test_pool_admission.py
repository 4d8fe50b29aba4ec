"""The fast backend's KV pool behind the server (issue 15): admission bounded by pool memory,
503 past the queue, pool use in /server_info and /metrics, batched answers equal serial ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ....support.client import EngineClient
from ....support.server import SERVER, TEST_ENV, ServerProcess

pytestmark = pytest.mark.slow

# Long enough that a request asking for the whole window outlasts the admission test many times.
WINDOW = 32768
PROMPTS = ["def parse(s):\n    ", "import json\n", "class Decoder:\n", "for key, value in"]


def _slot_gib(target, drafter) -> float:
    from ddtree.engine.reference.engine import Engine

    engine = Engine.load(target, drafter, backend="fast", context_window=WINDOW, pool_slots=1)
    return engine.pool_usage()["bytes"] / 2**30


@pytest.fixture(scope="module")
def pooled(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    gib = 2.5 * _slot_gib(target, drafter)  # room for two requests, not three
    proc = ServerProcess([*SERVER, "--model", str(target), "--draft", str(drafter), "--backend", "fast",
                          "--context-window", str(WINDOW), "--kv-pool-gb", f"{gib:.9f}", "--budget", "8",
                          "--max-running-requests", "8", "--max-queued-requests", "1", "--port", "0"],
                         tmp_path_factory.mktemp("pooled") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log_tail()


def test_pool_memory_bounds_the_running_requests(pooled):
    with EngineClient(pooled.url, timeout=60) as client:
        info = client.server_info()
        assert info["backend"] == "fast"
        assert info["kv_pool"]["slots"] == 2 and info["max_running_requests"] == 2
        assert info["kv_pool"]["free_slots"] == 2 and info["kv_pool"]["bytes_per_token"] > 0
        families = {f.name: f for f in text_string_to_metric_families(client.metrics_text())}
        assert families["ddtree:kv_pool_slots"].samples[0].value == 2
        assert families["sglang:token_usage"].samples[0].value == 0
    assert "the KV pool holds 2 requests" in pooled.log_tail()


def test_past_the_pool_and_the_queue_answers_503(pooled):
    """2 running (the pool) + 1 queued fit; every request past them gets 503 at once.

    The requests go in one at a time, each after the server shows the one before it running or
    queued (counted polls), so what is tested is the admission rule, not how fast a burst
    arrives; each asks for the whole window, far more rounds than the test takes."""

    def states(client):
        info = client.server_info()
        return info["internal_states"][0]["num_running_reqs"], info["internal_states"][0]["num_queue_reqs"]

    def wait_for(client, want):
        for _ in range(2000):
            if states(client) == want:
                return
            time.sleep(0.01)
        assert states(client) == want

    async def requests():
        statuses = []
        body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": WINDOW - 64, "temperature": 0.0,
                                                        "ignore_eos": True},
                "speculative": {"algorithm": "ar"}, "stream": True}
        with EngineClient(pooled.url, timeout=60) as client:
            async with httpx.AsyncClient(timeout=120) as http, contextlib.AsyncExitStack() as stack:
                for want in ((1, 0), (2, 0), (2, 1)):
                    r = await stack.enter_async_context(http.stream("POST", pooled.url + "/generate", json=body))
                    statuses.append(r.status_code)
                    await asyncio.to_thread(wait_for, client, want)
                for _ in range(3):
                    r = await http.post(pooled.url + "/generate", json=body)
                    statuses.append(r.status_code)
                    assert r.json()["code"] == 503
                still = states(client)  # the three held ones are still there
        return statuses, still

    statuses, still = asyncio.run(requests())
    assert statuses == [200, 200, 200, 503, 503, 503] and still == (2, 1)
    with EngineClient(pooled.url, timeout=60) as client:
        for _ in range(600):  # counted polls: the streams were dropped, their slots come back
            if client.server_info()["kv_pool"]["free_slots"] == 2:
                break
            time.sleep(0.05)
        assert client.server_info()["kv_pool"]["free_slots"] == 2


def test_concurrent_requests_on_the_pool_equal_serial(pooled):
    specs = [{"algorithm": "ar"}, {"algorithm": "dflash"}, {"algorithm": "ddtree", "budget": 8},
             {"algorithm": "ddtree", "budget": 2}]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    with EngineClient(pooled.url, timeout=120) as client:
        want = [client.generate(p, sampling_params=params, speculative=s)["output_ids"]
                for p, s in zip(PROMPTS, specs)]

    async def together():
        async with httpx.AsyncClient(timeout=120) as http:
            async def one(p, s):
                r = await http.post(pooled.url + "/generate",
                                    json={"text": p, "sampling_params": params, "speculative": s})
                return r.json()["output_ids"]
            return await asyncio.gather(*(one(p, s) for p, s in zip(PROMPTS[:3], specs[:3])))
    got = asyncio.run(together())
    # Whether they overlapped depends on timing; what they decode must not (test_fast_pool.py
    # shows, by counting, that pool rounds batch).
    assert got == want[:3]


def test_a_pool_too_small_for_one_request_is_one_line(tiny_pair):
    target, drafter = tiny_pair
    done = subprocess.run([*SERVER, "--model", str(target), "--draft", str(drafter), "--backend", "fast",
                           "--context-window", str(WINDOW), "--kv-pool-gb", "0.000001", "--port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **TEST_ENV})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines and "holds no session" in lines[0] and "Traceback" not in done.stderr
