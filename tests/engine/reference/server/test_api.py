"""The builtin server over real HTTP: a real subprocess on a free port, tiny random models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ....support.client import AsyncEngineClient, EngineBadRequest, EngineClient, EngineOverloaded, EngineUnreachable
from ....support.pair import CONTEXT_WINDOW
from ....support.server import CLI, ServerProcess

# Every test here talks to real server subprocesses (one per module, some start their own).
pytestmark = pytest.mark.slow

PROMPTS = ["def parse(s):\n    ", "import json\n", "class Decoder:\n", "for key, value in", "return self."]


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.url, timeout=120) as c:
        yield c


def greedy(n: int = 16, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, **extra}


def wait_idle(client: EngineClient, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = client.server_info()["internal_states"][0]
        if states["num_running_reqs"] == 0 and states["num_queue_reqs"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("requests still held by the server")


def test_announcement_and_health(server, client):
    assert server.announcement["event"] == "listening"
    assert server.announcement["host"] == "127.0.0.1"
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert client.health()
    info = client.server_info()
    # The drafter was trained with blocks of 4; the server runs it with --block-size 3.
    assert info["algorithm"] == "ddtree" and info["budget"] == 8 and info["block_size"] == 3
    assert info["context_length"] == CONTEXT_WINDOW
    assert info["batch"] is True  # batched rounds are the default
    assert "avg_spec_accept_length" in info["internal_states"][0]
    assert httpx.get(server.url + "/get_server_info").json()["model"] == info["model"]


def test_auto_backend_takes_transformers_on_a_cpu_and_says_why(server, client):
    info = client.server_info()
    assert info["backend"] == server.announcement["backend"] == "transformers"
    assert info["backend_reason"].startswith("auto:") and "CUDA" in info["backend_reason"]
    assert info["cuda_graphs"] is False and info["attention_kernel"] == "transformers"
    assert info["cublas_workspace"] is None  # only the fast backend on CUDA asks (fast/blas.py)
    # A CPU server leaves a core to the HTTP side, unless OMP_NUM_THREADS says otherwise.
    env = os.environ.get("OMP_NUM_THREADS")
    assert info["cpu_threads"] == (int(env) if env else max(1, len(os.sched_getaffinity(0)) - 1))


def test_fast_and_transformers_backends_serve_the_same_greedy_tokens(server, client, tiny_pair, tmp_path):
    """The backend decides how a round is computed, never what it commits."""
    target, drafter = tiny_pair
    # the drafter as the HF cache holds a download, to see /server_info name it by its repo id
    cached = tmp_path / "hub" / "models--acme--tiny-drafter" / "snapshots" / ("0" * 40)
    cached.parent.mkdir(parents=True)
    cached.symlink_to(drafter, target_is_directory=True)
    fast = ServerProcess([*CLI, "serve", "--model", str(target), "--draft", str(cached), "--port", "0",
                          "--budget", "8", "--block-size", "3", "--backend", "fast"], tmp_path / "fast.log")
    try:
        assert fast.announcement["backend"] == "fast"
        with EngineClient(fast.url, timeout=120) as other:
            info = other.server_info()
            assert info["backend"] == "fast" and info["backend_reason"] and info["cuda_graphs"] is False
            assert info["attention_kernel"] == "sdpa"  # the CPU's; triton's kernel is for CUDA
            assert info["draft_model"] == "acme/tiny-drafter" and info["speculative_draft_model_path"] == str(cached)
            for prompt in PROMPTS[:3]:
                for spec in ({"algorithm": "ar"}, {"algorithm": "dflash"}, {"algorithm": "ddtree", "budget": 8}):
                    want = client.generate(prompt, sampling_params=greedy(20, ignore_eos=True), speculative=spec)
                    got = other.generate(prompt, sampling_params=greedy(20, ignore_eos=True), speculative=spec)
                    assert got["output_ids"] == want["output_ids"], (prompt, spec)
    finally:
        assert fast.stop() == 0, fast.log_path.read_text()[-3000:]


def test_generate_meta_info(client):
    out = client.generate(PROMPTS[0], sampling_params=greedy(24, ignore_eos=True))
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 24
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_num_proposed_drafts"] == 8 * meta["spec_verify_ct"]


def test_plain_decoding_reports_no_acceptance(client):
    """As SGLang without a speculative algorithm: no spec fields, no verify calls counted."""
    before = client.metrics_text()
    meta = client.generate(PROMPTS[0], sampling_params=greedy(12, ignore_eos=True),
                           speculative={"algorithm": "ar"})["meta_info"]
    assert meta["completion_tokens"] == 12 and "spec_verify_ct" not in meta
    verify_line = next(line for line in client.metrics_text().splitlines()
                       if line.startswith("sglang:spec_verify_calls_total"))
    assert verify_line in before


def test_algorithms_agree_at_temperature_zero(client):
    """Speculation is lossless: ar, dflash and ddtree (any budget) give the same tokens at T=0."""
    ids = client.generate(PROMPTS[1], sampling_params=greedy(20, ignore_eos=True),
                          speculative={"algorithm": "ar"})["output_ids"]
    for spec in ({"algorithm": "dflash"}, {"algorithm": "ddtree", "budget": 3}, {"algorithm": "ddtree", "budget": 40}):
        out = client.generate(PROMPTS[1], sampling_params=greedy(20, ignore_eos=True), speculative=spec)
        assert out["output_ids"] == ids, spec
        assert out["meta_info"]["spec_algorithm"] == spec["algorithm"]


def test_input_ids_equal_text(client, tiny_pair):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_pair[0])).encode(PROMPTS[2])
    by_text = client.generate(PROMPTS[2], sampling_params=greedy(10))
    by_ids = client.generate(input_ids=ids, sampling_params=greedy(10))
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert client.completions(ids, max_tokens=10, temperature=0)["choices"][0]["text"] == by_text["text"]
    assert client.completions(PROMPTS[2], max_tokens=10, temperature=0)["choices"][0]["text"] == by_text["text"]


def test_stream_matches_non_stream(client):
    whole = client.generate(PROMPTS[3], sampling_params=greedy(20, ignore_eos=True))
    chunks = list(client.generate_stream(PROMPTS[3], sampling_params=greedy(20, ignore_eos=True)))
    lengths = [len(c["output_ids"]) for c in chunks]
    # Cumulative, as SGLang streams by default. How many chunks is the box's business: updates that
    # queue up behind a slow event loop leave as one.
    assert lengths == sorted(set(lengths)) and lengths[0] > 0
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert last["meta_info"]["spec_verify_ct"] == whole["meta_info"]["spec_verify_ct"]


def test_raw_stream_framing(server):
    body = {"text": PROMPTS[0], "sampling_params": greedy(4), "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_openai_completions(client):
    out = client.completions(PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True)
    assert out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 12
    chunks = list(client.completions(PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True, stream=True,
                                     stream_options={"include_usage": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == out["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]


def test_openai_chat(client, server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = client.chat(messages, max_tokens=8, temperature=0)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    chunks = list(client.chat(messages, max_tokens=8, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == out["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # The chat template was applied: the prompt is longer than the raw message text.
    assert out["usage"]["prompt_tokens"] > client.generate("be brief hello", sampling_params=greedy(1))[
        "meta_info"]["prompt_tokens"]


def test_stop_string_trims_output(client):
    reference = client.generate(PROMPTS[0], sampling_params=greedy(24, ignore_eos=True))
    text = reference["text"]
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]),
                None)
    if stop is None:
        pytest.skip("the random model produced no usable stop string")
    out = client.generate(PROMPTS[0], sampling_params=greedy(24, ignore_eos=True, stop=stop))
    assert out["text"] == text[:text.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == reference["output_ids"][:len(out["output_ids"])]
    # Streamed deltas never run past the stop string, so they add up to the same text.
    chunks = list(client.completions(PROMPTS[0], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                     stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_concurrent_clients_match_serial(client, server):
    """Batched rounds change nothing: concurrent results equal serial ones at T=0, with prompts of
    different lengths and mixed algorithms joining and leaving the batch."""
    specs = ({"algorithm": "ddtree", "budget": 8}, {"algorithm": "ar"}, {"algorithm": "dflash"},
             {"algorithm": "ddtree", "budget": 2})
    jobs = [(p, specs[i % len(specs)], 6 + 4 * i) for i, p in enumerate(PROMPTS)] + [(PROMPTS[0], specs[0], 16)]
    before = client.server_info()["internal_states"][0]["batched_rounds_total"]
    serial = [client.generate(p, sampling_params=greedy(n, ignore_eos=True), speculative=s)["output_ids"]
              for p, s, n in jobs]

    async def run_all():
        async with AsyncEngineClient(server.url, timeout=120) as ac:
            return await asyncio.gather(*(ac.generate(p, sampling_params=greedy(n, ignore_eos=True), speculative=s)
                                          for p, s, n in jobs))

    results = asyncio.run(run_all())
    assert [r["output_ids"] for r in results] == serial
    states = client.server_info()["internal_states"][0]
    assert states["batched_rounds_total"] > before and states["avg_batch_size"] > 1
    # The engine process's turns, and the share of them inside engine calls, cross to /server_info.
    assert states["scheduler_turns_total"] >= states["batched_rounds_total"]
    assert 0 < states["engine_seconds_total"] <= states["scheduler_turn_seconds_total"]
    assert states["late_triton_compiles"] is None  # watched only where CUDA graphs run


def test_seeded_sampling_is_reproducible_under_concurrency(client, server):
    params = {"max_new_tokens": 16, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    alone = client.generate(PROMPTS[4], sampling_params=params)["output_ids"]

    async def pair():
        async with AsyncEngineClient(server.url, timeout=120) as ac:
            return await asyncio.gather(ac.generate(PROMPTS[4], sampling_params=params),
                                        ac.generate(PROMPTS[0], sampling_params={**params, "seed": 8}))

    together, _ = asyncio.run(pair())
    assert together["output_ids"] == alone


def test_short_request_is_not_starved(client, server):
    """A short request submitted while a long one decodes finishes within its own rounds: one
    scheduler turn per token for plain decoding, whatever the long one has left. Counted in the
    turns meta_info reports, never in seconds, so a loaded machine cannot fail it."""
    short_tokens = 4
    with EngineClient(server.url, timeout=120) as long_client:
        # Streamed, so the first chunk proves the long request is decoding before the short one is sent.
        stream = long_client.generate_stream(PROMPTS[1], sampling_params=greedy(CONTEXT_WINDOW - 64, ignore_eos=True),
                                             speculative={"algorithm": "ar"})
        long_first = next(stream)["meta_info"]["scheduler_turns"]
        short = client.generate(PROMPTS[2], sampling_params=greedy(short_tokens, ignore_eos=True),
                                speculative={"algorithm": "ar"})["meta_info"]
        stream.close()  # cancels the long request
    turns = short["scheduler_turns"]
    assert long_first["first_token"] is not None and long_first["first_token"] <= turns["submitted"]
    assert turns["submitted"] < turns["first_token"] <= turns["finished"]
    # Admitted at the next turn (a slot is free), then one token per turn.
    assert turns["finished"] - turns["submitted"] <= short_tokens
    wait_idle(client)


def test_metrics_parse_with_prometheus_parser(client, server):
    client.generate(PROMPTS[0], sampling_params=greedy(8))
    families = {f.name: f for f in text_string_to_metric_families(client.metrics_text())}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:spec_accept_length",
                 "sglang:spec_accept_rate", "sglang:gen_throughput", "sglang:prompt_tokens",
                 "sglang:generation_tokens", "sglang:spec_verify_calls", "sglang:num_requests",
                 "sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"):
        assert name in families, name
    value = {f.name: f.samples[0].value for f in families.values()}
    assert value["sglang:generation_tokens"] >= 8
    assert value["sglang:spec_verify_calls"] > 0
    assert value["sglang:spec_accept_length"] >= 1.0
    ttft = {s.name: s.value for s in families["sglang:time_to_first_token_seconds"].samples}
    assert ttft["sglang:time_to_first_token_seconds_count"] >= 1
    assert families["sglang:num_running_reqs"].samples[0].labels["model_name"]


BAD = [
    ("malformed json", b"{not json"),
    ("not an object", b"[1, 2]"),
    ("text wrong type", {"text": 5}),
    ("input_ids wrong type", {"input_ids": ["a", "b"]}),
    ("input_ids out of vocab", {"input_ids": [10 ** 7]}),
    ("both text and ids", {"text": "x", "input_ids": [1]}),
    ("sampling_params wrong type", {"text": "x", "sampling_params": [1]}),
    ("max_new_tokens string", {"text": "x", "sampling_params": {"max_new_tokens": "5"}}),
    ("max_new_tokens negative", {"text": "x", "sampling_params": {"max_new_tokens": -3}}),
    ("max_new_tokens zero", {"text": "x", "sampling_params": {"max_new_tokens": 0}}),
    ("max_new_tokens absurd", {"text": "x", "sampling_params": {"max_new_tokens": 10 ** 12}}),
    ("temperature negative", {"text": "x", "sampling_params": {"temperature": -0.5}}),
    ("temperature string", {"text": "x", "sampling_params": {"temperature": "hot"}}),
    ("top_p zero", {"text": "x", "sampling_params": {"top_p": 0}}),
    ("stream wrong type", {"text": "x", "stream": "yes"}),
    ("unknown sampling param", {"text": "x", "sampling_params": {"max_tokens": 5}}),
    ("unsupported top_k", {"text": "x", "sampling_params": {"top_k": 5}}),
    ("budget negative", {"text": "x", "speculative": {"budget": -1}}),
    ("budget beyond max", {"text": "x", "speculative": {"budget": 1025}}),
    ("budget wrong type", {"text": "x", "speculative": {"budget": 2.5}}),
    ("unknown algorithm", {"text": "x", "speculative": {"algorithm": "medusa"}}),
    ("speculative wrong type", {"text": "x", "speculative": "ddtree"}),
    ("empty prompt", {"text": ""}),
    ("empty input_ids", {"input_ids": []}),
    ("prompt beyond context window", {"input_ids": [5] * (CONTEXT_WINDOW + 10)}),
    ("prompt + max_new_tokens beyond window", {"input_ids": [5] * 400, "sampling_params": {"max_new_tokens": 200}}),
    ("batch text", {"text": ["a", "b"]}),
    ("deeply nested JSON", b"[" * 100_000),
    ("deeply nested object", b'{"text": ' + b"[" * 100_000),
    ("prompt text far beyond the window", {"text": "x" * (CONTEXT_WINDOW * 40)}),
]


@pytest.mark.parametrize("body", [b for _, b in BAD], ids=[n for n, _ in BAD])
def test_bad_generate_gets_400_and_server_keeps_serving(server, body):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/generate", timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_long_prompt_is_refused_before_tokenizing(server):
    """The length check runs first: the error names characters, not tokens."""
    r = httpx.post(server.url + "/generate", json={"text": "def f():\n" * (CONTEXT_WINDOW * 8)}, timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["message"]


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "chunked"])
def test_an_oversized_body_gets_413_and_server_keeps_serving(server, declare):
    from ddtree.engine.reference.server import MAX_BODY_BYTES

    payload = b'{"text": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    if declare:
        r = httpx.post(server.url + "/generate", content=payload, timeout=60)
    else:
        r = httpx.post(server.url + "/generate", content=iter([payload[i:i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]),
                       timeout=60)
    assert r.status_code == 413, r.text[:200]
    assert r.json()["code"] == 413
    assert httpx.get(server.url + "/health").status_code == 200


BAD_OPENAI = [
    ("/v1/completions", {"prompt": 3}),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "n": 2}),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "speculative": {"budget": -2}}),
]


@pytest.mark.parametrize("path,body", BAD_OPENAI)
def test_bad_openai_request_gets_400(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == 400


def test_unknown_route_is_json_404(server):
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and r.json()["code"] == 404


def test_client_disconnect_mid_stream_leaks_nothing(client, server):
    reference = client.generate(PROMPTS[3], sampling_params=greedy(12, ignore_eos=True))
    body = {"text": PROMPTS[0], "sampling_params": greedy(400, ignore_eos=True), "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(3)) if line.startswith("data:")]
        assert got
    wait_idle(client)
    # A non-streaming client that gives up (read timeout) is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=0.5))
    wait_idle(client)
    again = client.generate(PROMPTS[3], sampling_params=greedy(12, ignore_eos=True))
    assert again["output_ids"] == reference["output_ids"]
    families = {f.name: f for f in text_string_to_metric_families(client.metrics_text())}
    assert families["sglang:num_aborted_requests"].samples[0].value >= 1


def test_queue_cap_answers_503(client, server):
    """4 running + 4 queued fit; the rest of a burst of 12 gets 503 right away."""

    async def burst():
        statuses = []
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"text": PROMPTS[1], "sampling_params": greedy(400, ignore_eos=True), "stream": True}
            async with contextlib.AsyncExitStack() as stack:
                async def open_one():
                    r = await stack.enter_async_context(http.stream("POST", server.url + "/generate", json=body))
                    statuses.append(r.status_code)
                    if r.status_code == 503:
                        assert json.loads(await r.aread())["code"] == 503
                await asyncio.gather(*(open_one() for _ in range(12)))
        return statuses

    # The engine is frozen through the burst, so no request ends before all 12 are answered (a
    # 400-token one could on a fast box, and a late arrival then took its slot): with one HTTP
    # process, that process admits and answers by its own count.
    (engine,) = psutil.Process(server.proc.pid).children()
    engine.suspend()
    try:
        statuses = asyncio.run(burst())
    finally:
        engine.resume()
    assert statuses.count(200) == 8 and statuses.count(503) == 4, statuses
    wait_idle(client)
    assert client.health()


def test_client_errors(server):
    with EngineClient(server.url) as c:
        with pytest.raises(EngineBadRequest) as info:
            c.generate("x", sampling_params={"temperature": -1})
        assert info.value.status == 400 and "temperature" in info.value.message
    with EngineClient("http://127.0.0.1:9") as c:  # discard port: nothing listens there
        assert not c.health()
        with pytest.raises(EngineUnreachable):
            c.server_info()
    assert issubclass(EngineOverloaded, EngineBadRequest.__mro__[1])


# -- keep last: it stops the module's server -------------------------------------------------------

def test_sigterm_finishes_in_flight_requests_and_exits_zero(server):
    result = {}

    def stream():
        with EngineClient(server.url, timeout=120) as c:
            result["chunks"] = list(c.generate_stream(PROMPTS[0], sampling_params=greedy(120, ignore_eos=True)))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the request is decoding
        if httpx.get(server.url + "/server_info").json()["internal_states"][0]["num_running_reqs"] > 0:
            break
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert result["chunks"][-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
    assert server.proc.wait(30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
