"""Several HTTP processes on one engine process (--tokenizer-worker-num): the engine routes each
request's updates to the process that sent it, lets go of a process that leaves while the others
run on, and adds up their TTFT and ITL for /metrics; the server starts and stops its workers."""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import httpx
import psutil
import pytest

from ddtree.engine.reference import engine_loop, server
from ddtree.engine.reference.engine import GenParams, SpecParams
from ddtree.engine.reference.scheduler import EngineThread, Update

from ....support.client import EngineClient
from ....support.server import SERVER, ServerProcess
from .test_engine_loop import PROMPTS, SPECS, gone, greedy_outputs

GEN = GenParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


class Collected:
    """A ticket's sink: its updates, and whether the last one has come."""

    def __init__(self) -> None:
        self.updates: queue.Queue[Update] = queue.Queue()

    def __call__(self, update: Update) -> None:
        self.updates.put(update)

    def result(self) -> tuple[list[int], str | None]:
        ids: list[int] = []
        while True:
            update = self.updates.get(timeout=120)
            ids += update.new_ids
            if update.done or update.error is not None:
                return ids, update.finish_reason


@pytest.fixture(scope="module")
def hosted(tiny_pair):
    """host() on a thread over two socket pairs, as the engine process runs it for two HTTP
    processes; yields (engine, config, [scheduler 0, scheduler 1]) and stops what is left."""
    target, drafter = tiny_pair
    args = server.build_parser().parse_args(["--model", str(target), "--draft", str(drafter), "--budget", "4",
                                             "--max-running-requests", "4", "--max-queued-requests", "4"])
    engine_thread = EngineThread()
    engine, config = server.prepare(args, engine_thread)
    pairs = [socket.socketpair() for _ in range(2)]
    theirs = [Connection(b.detach()) for _, b in pairs]
    hosting = threading.Thread(target=engine_loop.host, args=(theirs, engine, config, engine_thread), daemon=True)
    hosting.start()
    schedulers = [engine_loop.RemoteScheduler(None, Connection(a.detach()), max_running=4, max_queued=4, workers=2)
                  for a, _ in pairs]
    for sched in schedulers:
        sched.start()
    yield engine, config, schedulers
    for sched in schedulers:
        if not sched._stopping:
            sched.stop(5.0)
    hosting.join(30)
    assert not hosting.is_alive(), "host() did not return after every HTTP process stopped"


def test_each_process_gets_its_own_requests_and_one_that_leaves_is_let_go(hosted, tiny_pair):
    engine, config, (first, second) = hosted
    # Each may send the engine all it holds; the engine admits (an "admitted" answer per request).
    assert first.capacity == second.capacity == 8 and first.confirms_admission
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    spec = SpecParams(algorithm="ddtree", budget=4)
    sinks = [(Collected(), Collected()) for _ in prompts]
    # The same prompts through both processes at once, their ids the same numbers on each side.
    for ids, (a, b) in zip(prompts, sinks):
        first.submit(ids, GEN, spec, a)
        second.submit(ids, GEN, spec, b)
    results = [(a.result(), b.result()) for a, b in sinks]
    for (mine, theirs), ids in zip(results, prompts):
        assert mine == theirs and mine[1] == "length" and len(mine[0]) == 12

    # Each sends its TTFT and ITL before its poll; a poll on one has the other's too.
    first.stats.observe_ttft(0.5)
    second.stats.observe_ttft(0.25)
    second.stats.observe_ttft(0.25)
    first.snapshot(0.0).result(timeout=60)  # a round trip: the first's count has reached the engine
    assert second.snapshot(0.0).result(timeout=60).stats.ttft.count == 3  # its own and the first's
    polled = first.snapshot(0.0).result(timeout=60)
    assert polled.stats.ttft.count == 3 and polled.stats.ttft.sum == pytest.approx(1.0)

    # The second leaves mid-request: its request is let go, the first's runs on to its end.
    long_gen = GenParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    kept, dropped = Collected(), Collected()
    first.submit(prompts[0], long_gen, SpecParams(algorithm="ar"), kept)
    second.submit(prompts[1], long_gen, SpecParams(algorithm="ar"), dropped)
    dropped.updates.get(timeout=120)  # it is decoding
    second.stop(5.0)
    ids, reason = kept.result()
    assert reason == "length" and len(ids) == 200
    for _ in range(600):  # counted polls until the engine has retired the let-go request
        snap = first.snapshot(0.0).result(timeout=60)
        if snap.running == 0 and snap.queued == 0:
            break
    assert (snap.running, snap.queued) == (0, 0)
    assert snap.stats.ttft.count == 3  # the second's still counted after it left: a counter never falls
    again = Collected()
    first.submit(prompts[2], GEN, spec, again)
    assert again.result() == results[2][0]


def test_the_server_starts_its_workers_answers_the_same_and_stops_them(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    srv = ServerProcess([*SERVER, "--model", str(target), "--draft", str(drafter), "--port", "0", "--budget", "4",
                         "--tokenizer-worker-num", "2", "--incremental-streaming-output"], tmp_path / "server.log")
    try:
        info = httpx.get(srv.url + "/server_info").json()
        assert info["tokenizer_worker_num"] == 2 and info["engine_loop"] == "process"
        assert info["incremental_streaming_output"] is True
        children = psutil.Process(srv.proc.pid).children()
        kinds = sorted(p.cmdline()[2] for p in children)
        assert kinds == ["ddtree.engine.reference.engine_loop", "ddtree.engine.reference.server"]
        (worker,) = [p for p in children if "--http-worker-of" in p.cmdline()]
        both_answer(srv)
        want = greedy_outputs(srv.url)
        # Many connections at once: the kernel hands them to both processes.
        client = EngineClient(srv.url)

        def one(k: int) -> list[int]:
            prompt, spec = PROMPTS[k // len(SPECS)], SPECS[k % len(SPECS)]
            return client.generate(prompt, sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                            "ignore_eos": True}, speculative=spec)["output_ids"]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(len(want)))) == want
        # --incremental-streaming-output: each chunk has only what is new; the pieces join to the
        # whole, with a stop string too (streaming holds back what may start one).
        params = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
        spec = {"algorithm": "ddtree", "budget": 4}
        text = client.generate(PROMPTS[1], sampling_params=params, speculative=spec)["text"]
        # A stop string first met in the text's second half (the tiny pair's weights are random).
        half = len(text) // 2
        stop = next((text[k:k + 3] for k in range(half, len(text) - 3) if text.find(text[k:k + 3]) == k), text[-3:])
        for extra in ({}, {"stop": [stop]}):
            ask = {**params, **extra}
            chunks = list(client.generate_stream(PROMPTS[1], sampling_params=ask, speculative=spec))
            plain = client.generate(PROMPTS[1], sampling_params=ask, speculative=spec)
            assert len(chunks) > 1 and "".join(c["text"] for c in chunks) == plain["text"]
            assert [t for c in chunks for t in c["output_ids"]] == plain["output_ids"]
            assert chunks[-1]["meta_info"]["completion_tokens"] == len(plain["output_ids"])
        assert plain["meta_info"]["finish_reason"]["type"] == "stop"
        # Every request's first token is counted once, whichever process served it and was polled.
        requests = 2 * len(want) + 5
        for _ in range(600):  # counted polls: each worker sends its counts every half second
            time.sleep(0.05)
            metrics = httpx.get(srv.url + "/metrics").text
            if f"time_to_first_token_seconds_count{{model_name=\"{info['served_model_name']}\"}} " \
               f"{float(requests)}" in metrics:
                break
        else:
            pytest.fail(f"TTFT never counted {requests} requests:\n{metrics[-2000:]}")
        # Every request has its access line, whichever process served it.
        assert srv.log_path.read_text().count("POST /generate 200") == requests
        # A worker that dies mid-stream: its request is let go, and the server serves on, alone.
        (engine,) = [p for p in children if p is not worker]
        for _ in range(200):  # counted tries: a new connection reaches the worker by address hash
            kept = httpx.Client(base_url=srv.url, timeout=120)
            if kept.get("/server_info").json()["http_pid"] == worker.pid:
                break
            kept.close()
        else:
            pytest.fail("no connection reached the worker")
        body = {"text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with contextlib.suppress(httpx.HTTPError), kept.stream("POST", "/generate", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))  # on the worker, streaming
            engine.suspend()  # so that the stream cannot end before its worker does
            worker.kill()
            assert gone(worker)
            engine.resume()
        kept.close()
        for _ in range(600):  # counted polls until the engine has let the request go (or it ended)
            if httpx.get(srv.url + "/server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the dead worker's request still runs")
        assert one(0) == want[0]  # it serves on: greedy, so the same tokens as before
        srv.proc.terminate()  # the server alone, not its group: it stops its workers itself
        assert srv.proc.wait(90) == 0, srv.log_tail()
        assert all(gone(p) for p in children), "a worker or the engine outlived the server"
        log = srv.log_path.read_text()
        assert log.count("exited with code") == 1, log[-2000:]
        assert f"an HTTP worker (pid {worker.pid}) exited with code -9; the server serves on without it" in log
    finally:
        srv.stop()


@pytest.mark.parametrize("extra", [["--tokenizer-worker-num", "0"], ["--tokenizer-worker-num", "99"],
                                   ["--tokenizer-worker-num", "2", "--engine-loop", "thread"]])
def test_a_bad_worker_count_is_refused_in_one_line_before_loading(extra):
    out = subprocess.run([*SERVER, *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "--tokenizer-worker-num" in out.stderr


def test_with_several_processes_the_engine_admits_and_a_refusal_is_still_a_503(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    srv = ServerProcess([*SERVER, "--model", str(target), "--draft", str(drafter), "--port", "0",
                         "--tokenizer-worker-num", "2", "--max-running-requests", "2", "--max-queued-requests", "2",
                         "--context-window", "16384"],
                        tmp_path / "server.log")
    try:
        main = psutil.Process(srv.proc.pid)
        (engine,) = [p for p in main.children() if "--http-worker-of" not in p.cmdline()]
        both_answer(srv)
        # Requests far longer than the test: none ends before all six are in, however late a loaded
        # box lets an HTTP process forward one after the engine resumes (a 300-token request could,
        # and the late one was then admitted into its slot). Each stream is read only to its
        # status; leaving then aborts it.
        body = {"text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 16000, "ignore_eos": True}}

        def stream(_) -> int:
            with httpx.stream("POST", srv.url + "/generate", json=body, timeout=120) as response:
                return response.status_code

        # Six at once, while the engine is frozen, so that all six reach it before any ends: it
        # holds four (2 running, 2 queued) whichever process each came through, and refuses two.
        # A process that got five by the port's address hash refuses its fifth itself, at once,
        # so a request counts as arrived when its connection is held or it has been answered.
        engine.suspend()
        try:
            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(stream, i) for i in range(6)]
                for _ in range(600):  # counted polls until all six have reached the server
                    held = sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == srv.port
                               for p in [main, *main.children()] for c in p.net_connections(kind="tcp"))
                    answered = sum(f.done() for f in futures)
                    if held + answered == 6:
                        break
                    time.sleep(0.05)
                else:
                    pytest.fail(f"{held} of the 6 connections are held and {answered} answered")
                assert answered <= 2
                engine.resume()
                statuses = sorted(f.result() for f in futures)
        finally:
            engine.resume()
        assert statuses == [200, 200, 200, 200, 503, 503]
    finally:
        srv.stop()


def both_answer(srv: ServerProcess) -> None:
    """Counted polls until both HTTP processes have answered on the port (new connections, spread
    by address hash; the worker listens once it has started)."""
    main = psutil.Process(srv.proc.pid)
    (worker,) = [p for p in main.children() if "--http-worker-of" in p.cmdline()]
    answered = set()
    for _ in range(600):
        answered.add(httpx.get(srv.url + "/server_info", headers={"Connection": "close"}).json()["http_pid"])
        if answered == {main.pid, worker.pid}:
            return
        time.sleep(0.05)
    assert answered == {main.pid, worker.pid}
