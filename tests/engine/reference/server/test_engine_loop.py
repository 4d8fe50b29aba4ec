"""The engine loop in a process of its own (--engine-loop process, the default), against a real
server: same tokens as the single-process server, the engine never outlives the server, and an
engine that dies fails what it held in one line instead of hanging it."""

from __future__ import annotations

import signal
import time

import httpx
import psutil
import pytest

from ....support.client import EngineClient
from ....support.server import SERVER, TEST_ENV, ServerProcess

PROMPTS = ["def add(a, b):", "The quick brown fox", "import numpy as np\n", "Once upon a time"]
SPECS = [{"algorithm": "ar"}, {"algorithm": "dflash"}, {"algorithm": "ddtree", "budget": 4},
         {"algorithm": "ddtree", "budget": 8}]


def start(tiny_pair, log_path, *extra: str) -> ServerProcess:
    target, drafter = tiny_pair
    return ServerProcess([*SERVER, "--model", str(target), "--draft", str(drafter), "--port", "0", "--budget", "4",
                          *extra], log_path)


def greedy_outputs(url: str) -> list[list[int]]:
    client = EngineClient(url)
    return [client.generate(p, sampling_params={"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
                            speculative=s)["output_ids"] for p in PROMPTS for s in SPECS]


def test_engine_process_serves_the_single_process_tokens_and_dies_with_the_server(tiny_pair, tmp_path):
    threaded = start(tiny_pair, tmp_path / "thread.log", "--engine-loop", "thread", "--chunked-prefill-size", "-1")
    try:
        info = httpx.get(threaded.url + "/server_info").json()
        assert info["engine_loop"] == "thread" and info["chunked_prefill_size"] == -1
        assert info["enable_mixed_chunk"] is False and info["max_prefill_tokens"] == 16384
        assert psutil.Process(threaded.proc.pid).children() == []
        want = greedy_outputs(threaded.url)
        drained = sigterm_mid_stream(threaded)
    finally:
        assert threaded.stop() == 0, threaded.log_tail()
    assert drained["meta_info"]["finish_reason"] == {"type": "length", "length": 100}
    # Prompts of 9-15 tokens in chunks of 3: the chunked prefill's tokens are checked here too,
    # and so are tokens sent 4 or more at a time, and new and running requests stepped in one
    # call (--enable-mixed-chunk; on this backend the prefills still run apart).
    srv = start(tiny_pair, tmp_path / "process.log", "--chunked-prefill-size", "3", "--stream-interval", "4",
                "--enable-mixed-chunk", "--max-prefill-tokens", "5")
    try:
        info = httpx.get(srv.url + "/server_info").json()
        assert info["engine_loop"] == "process" and info["backend"] == "transformers"
        assert info["engine_outbox"] == "inline"  # a CPU's round: the engine's thread writes at once
        assert info["chunked_prefill_size"] == 3 and info["stream_interval"] == 4
        assert info["enable_mixed_chunk"] is True and info["max_prefill_tokens"] == 5
        assert info["disable_overlap_schedule"] is True  # the transformers backend runs no round ahead
        engines = psutil.Process(srv.proc.pid).children()
        assert [p.cmdline()[1:3] for p in engines] == [["-m", "ddtree.engine.reference.engine_loop"]]
        assert greedy_outputs(srv.url) == want
        # The counters live in the engine process and reach /metrics through the pipe.
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'sglang:num_requests_total{{model_name="{info["served_model_name"]}"}} {float(len(want))}' in metrics
        chunks = list(EngineClient(srv.url).generate_stream(PROMPTS[1], sampling_params={
            "max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}, speculative={"algorithm": "ar"}))
        sizes = [len(c["output_ids"]) for c in chunks]
        # AR commits a token a round: the first leaves at once, then 4 at a time, the rest at the end,
        # so a chunk ends after token 1, 5, 9, ... 29 or 30. The HTTP side may merge updates that
        # queue up behind a slow event loop (a loaded box), so a chunk may end at fewer of them, never
        # anywhere else.
        sent = {1, *range(5, 30, 4), 30}
        assert sizes[-1] == 30 and set(sizes) <= sent and sizes == sorted(set(sizes)), sizes
        srv.proc.kill()  # the server dies without a word to its engine
        srv.proc.wait()
        assert gone(engines[0]), "the engine process outlived a killed server"
    finally:
        srv.stop()


def test_updates_held_for_the_gpus_wait_all_arrive_in_order(tiny_pair, tmp_path):
    """The outbox's "wait" mode (a fast engine on a GPU) forced on the CPU's fast backend: the
    engine's thread writes the held updates where a round would wait for the GPU (a batched
    prefill, an AR step), at a flush once they are old, and when the work runs out. Requests
    side by side, every algorithm: each greedy output is AR's, each stream adds up to it."""
    from concurrent.futures import ThreadPoolExecutor

    target, drafter = tiny_pair
    srv = ServerProcess([*SERVER, "--model", str(target), "--draft", str(drafter), "--port", "0", "--backend", "fast",
                         "--max-running-requests", "8"], tmp_path / "wait.log",
                        env={**TEST_ENV, "DDTREE_OUTBOX": "wait"})
    try:
        client = EngineClient(srv.url, timeout=120)
        assert client.server_info()["engine_outbox"] == "wait"
        params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        jobs = [(p, s) for p in PROMPTS for s in SPECS]
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda job: client.generate(job[0], sampling_params=params,
                                                             speculative=job[1])["output_ids"], jobs))
        ar = {p: out for (p, s), out in zip(jobs, outs) if s["algorithm"] == "ar"}
        assert all(out == ar[p] for (p, _), out in zip(jobs, outs))
        chunks = list(client.generate_stream(PROMPTS[2], sampling_params=params, speculative={"algorithm": "ar"}))
        assert chunks[-1]["output_ids"] == ar[PROMPTS[2]]
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        assert srv.stop() == 0, srv.log_tail()



def sigterm_mid_stream(srv: ServerProcess) -> dict:
    """SIGTERM while a stream decodes; the stream's last chunk (the server lets it finish)."""
    import threading

    chunks: list = []

    def stream():
        client = EngineClient(srv.url, timeout=120)
        chunks.extend(client.generate_stream(PROMPTS[0], sampling_params={
            "max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True}))

    reader = threading.Thread(target=stream)
    reader.start()
    for _ in range(3000):  # counted polls until the request is decoding
        if httpx.get(srv.url + "/server_info").json()["internal_states"][0]["num_running_reqs"] > 0:
            break
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    reader.join(120)
    assert srv.proc.wait(60) == 0
    return chunks[-1]


def gone(proc: psutil.Process, polls: int = 600) -> bool:
    """Whether proc exits within `polls` polls of 0.1 s (a zombie, waiting for a PID 1 that may
    never reap it, counts as exited)."""
    for _ in range(polls):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_an_engine_that_dies_fails_its_requests_and_the_server_in_one_line(tiny_pair, tmp_path):
    srv = start(tiny_pair, tmp_path / "server.log", "--context-window", "16384")
    try:
        (engine,) = psutil.Process(srv.proc.pid).children()
        # Far longer than the test, so that a stall between the first chunk and the signal cannot
        # let the stream end first.
        body = {"text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 16000, "ignore_eos": True}}
        with httpx.stream("POST", srv.url + "/generate", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert "output_ids" in first  # the request is held: it is streaming
            # Frozen at once, then killed.
            engine.send_signal(signal.SIGSTOP)
            engine.kill()
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert "the engine process exited" in rest[-2], rest[-2:]
        assert srv.proc.wait(60) == 1
        errors = [line for line in srv.log_tail().splitlines() if line.startswith("error:")]
        assert errors == [f"error: the engine process exited (exit code {-signal.SIGKILL})"]
    finally:
        srv.stop()


@pytest.mark.parametrize("flag", ["--chunked-prefill-size", "--stream-interval"])
def test_a_bad_prefill_chunk_or_stream_interval_is_refused_in_one_line_before_loading(flag):
    import subprocess

    out = subprocess.run([*SERVER, flag, "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and flag in out.stderr


def test_a_trace_path_that_cannot_be_written_is_refused_in_one_line_before_loading(tmp_path):
    import subprocess

    out = subprocess.run([*SERVER, "--trace-turns", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "--trace-turns" in out.stderr


def test_a_model_that_fails_to_load_is_one_line_from_the_server(tmp_path):
    import subprocess

    out = subprocess.run([*SERVER, "--model", str(tmp_path / "missing"), "--port", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "missing" in lines[-1]
    assert "Traceback" not in out.stderr
