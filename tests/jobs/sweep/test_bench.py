"""The bench client against a real builtin server subprocess (tiny random pair, loopback)."""

import gc
import socket

import pytest

from ddtree.engine.serving import bench
from ddtree.engine.serving.bench import BenchConfig, EngineNotReady, run_point, wait_ready
from ...support.client import EngineClient
from ddtree.engine.serving.prompts import Prompt, load_prompts

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

PROMPTS = [Prompt(f"def f{i}(x):\n    return x + {i}\n") for i in range(6)]


def test_generate_api_ddtree_point_has_every_figure(server):
    result = run_point(server.url, PROMPTS, BenchConfig(concurrency=2, max_new_tokens=8, warmup=1,
                                                        speculative={"algorithm": "ddtree", "budget": 6}))
    m = result.metrics
    assert m["requests_ok"] == 6 and m["requests_failed"] == 0
    assert len(result.requests) == 6  # warm-up left out
    with EngineClient(server.url) as client:
        block = client.server_info()["block_size"]
    for r in result.requests:
        assert r.ok and 1 <= r.completion_tokens <= 8 and r.prompt_tokens > 0
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.verify_ct >= 1 and 1.0 <= r.accept_length <= block
        assert len(r.itl_s) <= r.completion_tokens - 1
        assert sum(r.accept_hist) == r.verify_ct
    assert m["output_tok_s"] > 0 and m["req_s"] > 0 and m["tok_s_per_user"] > 0
    assert 1.0 <= m["tau_weighted"] <= block and 1.0 <= m["tau_mean"] <= block
    assert m["ttft_p50"] <= m["ttft_p99"] and m["e2e_p50"] <= m["e2e_p99"]
    assert m["output_tokens"] == sum(r.completion_tokens for r in result.requests)
    assert "5 x concurrency 2" in result.warnings[0]


def test_openai_api_counts_tokens_from_usage(server):
    result = run_point(server.url, PROMPTS[:3], BenchConfig(concurrency=1, max_new_tokens=6, api="openai"))
    assert result.metrics["requests_ok"] == 3
    for r in result.requests:
        assert 1 <= r.completion_tokens <= 6 and r.prompt_tokens > 0 and r.ttft_s <= r.e2e_s


def test_server_rejection_is_a_counted_failure_not_a_crash(server):
    result = run_point(server.url, PROMPTS[:2], BenchConfig(max_new_tokens=4,
                                                            speculative={"algorithm": "ddtree", "budget": -3}))
    assert result.metrics["requests_ok"] == 0
    assert result.metrics["failures"] == {"http 400": 2}
    assert "budget" in result.requests[0].detail


def _freeze_counts(monkeypatch) -> list[int]:
    """How many objects gc.freeze had set aside as each batch of requests (warm-up, then the
    measured one) began."""
    seen, run = [], bench._run_requests

    async def counted(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return await run(*args, **kwargs)

    monkeypatch.setattr(bench, "_run_requests", counted)
    return seen


def test_the_measured_requests_run_with_the_heap_out_of_the_collections(server, monkeypatch):
    """A full collection of a heap with torch in it stalls the client ~0.1 s, with the server idle
    meanwhile: the point's requests run with what was alive before them frozen, and the heap
    is the caller's again after."""
    gc.unfreeze()  # whatever an earlier test in this process froze: the client's own case here
    heap = [{"n": i} for i in range(20_000)]  # alive before the point: must not be walked during it
    seen = _freeze_counts(monkeypatch)
    result = run_point(server.url, PROMPTS[:2], BenchConfig(concurrency=2, max_new_tokens=4, warmup=1))
    assert result.metrics["requests_ok"] == 2
    warm, measured = seen
    assert warm == 0 and measured >= len(heap)
    assert gc.get_freeze_count() == 0


def test_a_heap_the_caller_froze_stays_frozen(server, monkeypatch):
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        seen = _freeze_counts(monkeypatch)
        run_point(server.url, PROMPTS[:1], BenchConfig(max_new_tokens=2))
        assert seen[0] >= before and gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_gives_connect_failures_and_not_ready():
    url = f"http://127.0.0.1:{_closed_port()}"
    result = run_point(url, PROMPTS[:2], BenchConfig(timeout_s=5))
    assert result.metrics["failures"] == {"connect": 2}
    with pytest.raises(EngineNotReady) as info:
        wait_ready(url, timeout_s=1.0, interval_s=0.1)
    assert "not ready after 1s" in str(info.value)


def test_prompt_sets(tmp_path, prompts_file):
    code = load_prompts("builtin:code", 5, seed=1)
    assert len(code) == 5 and all(p.text for p in code)
    assert load_prompts("builtin:code", 5, seed=1) == code
    wrap = load_prompts(str(prompts_file), 30)
    assert len(wrap) == 30 and len({p.text for p in wrap}) == 12
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"question": "2+2?"}\n')
    got = load_prompts(str(chat), 2)
    assert {p.text for p in got} == {"hi", "2+2?"}
    from ddtree.engine.serving.prompts import DatasetError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    huge = tmp_path / "huge.jsonl"  # a number past int()'s 4300 digits: a ValueError, not a JSONDecodeError
    huge.write_text('{"prompt": "ok", "n": 1' + "0" * 5000 + '}\n')
    for name, needle in ((str(bad), "bad.jsonl:2 is not JSON"), (str(huge), "huge.jsonl:1 is not JSON"),
                         ("builtin:nope", "no builtin prompt set"),
                         ("humaneval-missing", "unknown dataset"), (str(tmp_path / "x.jsonl"), "not found")):
        with pytest.raises(DatasetError) as info:
            load_prompts(name, 1)
        assert needle in str(info.value) and info.value.exit_code == 2


def test_spread_output_lengths_draws_as_bench_serving_and_repeats_with_its_seed():
    from ddtree.engine.serving.prompts import DatasetError, spread_output_lengths

    prompts = [Prompt(f"p{i}") for i in range(400)]
    assert spread_output_lengths(prompts, 64, 1.0) == prompts  # every prompt the point's length
    spread = spread_output_lengths(prompts, 64, 0.25)
    lengths = [p.max_new_tokens for p in spread]
    assert min(lengths) == 16 and max(lengths) == 64 and len(set(lengths)) == 49
    assert [p.text for p in spread] == [p.text for p in prompts]
    assert spread_output_lengths(prompts, 64, 0.25) == spread
    assert spread_output_lengths(prompts, 64, 0.25, seed=1) != spread
    assert {p.max_new_tokens for p in spread_output_lengths(prompts, 3, 0.0)} == {1, 2, 3}
    with pytest.raises(DatasetError, match="between 0 and 1"):
        spread_output_lengths(prompts, 64, 1.5)


@pytest.mark.parametrize("api", ["generate", "openai"])
def test_a_prompts_own_output_length_is_what_the_client_asks_for(server, api):
    """Prompt.max_new_tokens (--output-len-ratio's lengths) goes in the request in place of the
    point's max_new_tokens; a prompt without one asks for the point's."""
    asked = [Prompt(PROMPTS[0].text, max_new_tokens=n) for n in (1, 3, 2)] + [PROMPTS[1]]
    result = run_point(server.url, asked, BenchConfig(concurrency=2, max_new_tokens=5, api=api,
                                                      speculative={"algorithm": "ar"} if api == "generate" else None))
    assert [r.completion_tokens for r in result.requests] == [1, 3, 2, 5]
    assert {r.finish_reason for r in result.requests} == {"length"}
