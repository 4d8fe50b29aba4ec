"""Acceptance from counter differences (two scrapes) and from per-request meta_info.

Payloads are produced by prometheus_client itself with the names and label sets SGLang 0.5.23
(observability/metrics_collector.py) and vLLM register, and cross-checked against
prometheus_client's own parser."""

from __future__ import annotations

import math

import pytest

from ddtree.engine.serving.metrics import (MetricsError, parse_prometheus, request_acceptance, run_acceptance,
                                   summarize_requests)

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


class FakeSGLang:
    def __init__(self):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                              labels + ["is_streaming"], registry=self.registry)
        self.verify = Counter("sglang:spec_verify_calls", "Number of speculative decoding verification calls.",
                              labels, registry=self.registry)
        self.requests = Counter("sglang:num_requests", "Number of requests processed.", labels + ["is_streaming"],
                                registry=self.registry)
        self.accept = Gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
                            labels, registry=self.registry)

    def finish(self, tokens, verify_ct, streaming=False):
        m = "moonshotai/Kimi-K2.6"
        s = "true" if streaming else "false"
        self.tokens.labels(model_name=m, is_streaming=s).inc(tokens)
        self.requests.labels(model_name=m, is_streaming=s).inc()
        if verify_ct:
            self.verify.labels(model_name=m).inc(verify_ct)
        self.accept.labels(model_name=m).set(tokens / max(verify_ct, 1))

    def scrape(self, at):
        text = generate_latest(self.registry).decode()
        return parse_prometheus(text, at=at), text


def test_sglang_run_tau_from_differences_not_cumulative():
    server = FakeSGLang()
    server.finish(1000, 500)  # warm-up / an earlier run: tau 2.0
    before, _ = server.scrape(at=100.0)
    server.finish(600, 100)
    server.finish(400, 100, streaming=True)  # summed over the is_streaming label sets
    after, text = server.scrape(at=130.0)
    run = run_acceptance("sglang", before, after)
    assert run.tau == pytest.approx(5.0)  # (600 + 400) / 200; cumulative would say 2000 / 700
    assert run.verify_calls == 200 and run.generated_tokens == 1000 and run.requests == 2
    assert run.seconds == 30.0 and not run.counter_reset
    # Our parser agrees with prometheus_client's on every sample.
    reference = {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for fam in text_string_to_metric_families(text) for s in fam.samples}
    ours = {(s.name, tuple(sorted(s.labels))): s.value for s in after.samples}
    assert ours == reference


def test_ar_run_has_no_tau_and_restart_is_flagged():
    server = FakeSGLang()
    before, _ = server.scrape(at=1.0)
    server.finish(256, 0)
    after, _ = server.scrape(at=2.0)
    assert run_acceptance("sglang", before, after).tau is None
    restarted = FakeSGLang()
    restarted.finish(10, 5)
    big = FakeSGLang()
    big.finish(5000, 1000)
    run = run_acceptance("sglang", big.scrape(at=1.0)[0], restarted.scrape(at=2.0)[0])
    assert run.counter_reset and run.tau == pytest.approx(2.0)


def test_vllm_run_tau_rate_and_positions():
    reg = CollectorRegistry()
    lab = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lab, registry=reg)
    draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", lab, registry=reg)
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", lab, registry=reg)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                      lab + ["position"], registry=reg)
    ids = dict(model_name="Qwen/Qwen3-8B", engine="0")

    def step(n_drafts, accepted_per_draft):
        drafts.labels(**ids).inc(n_drafts)
        draft_tokens.labels(**ids).inc(n_drafts * 15)
        accepted.labels(**ids).inc(n_drafts * accepted_per_draft)
        for pos in range(15):
            per_pos.labels(**ids, position=str(pos)).inc(n_drafts if pos < accepted_per_draft else 0)

    step(100, 2)
    before = parse_prometheus(generate_latest(reg).decode(), at=0.0)
    step(50, 5)
    after = parse_prometheus(generate_latest(reg).decode(), at=10.0)
    run = run_acceptance("vllm", before, after)
    assert run.tau == pytest.approx(6.0) and run.accept_rate == pytest.approx(5 / 15)
    assert run.per_position[:6] == pytest.approx([1, 1, 1, 1, 1, 0]) and len(run.per_position) == 15


def test_parser_edge_cases():
    text = ('# HELP x A metric.\n# TYPE x counter\nx_total{a="q\\"uote",b="back\\\\slash"} 3 1700000000000\n'
            'y NaN\nz +Inf\nthis is not a sample\nw{bad} 1\n')
    scrape = parse_prometheus(text, at=0)
    assert scrape.total("x_total") == 3 and scrape.select("x_total")[0].label("a") == 'q"uote'
    assert scrape.select("x_total")[0].label("b") == "back\\slash"
    assert math.isinf(scrape.total("z")) and scrape.total("y") is None and scrape.skipped == 2
    assert scrape.types == {"x": "counter"}
    with pytest.raises(MetricsError):
        run_acceptance("tgi", scrape, scrape)


# meta_info as SGLang 0.5.23's tokenizer manager writes it (DFLASH, block 16), and the builtin's.
SGLANG_META = {"id": "5c1f", "finish_reason": {"type": "length", "length": 256}, "prompt_tokens": 118,
               "completion_tokens": 256, "cached_tokens": 0, "e2e_latency": 1.9021,
               "spec_accept_rate": 0.3583, "spec_accept_length": 6.4, "spec_num_correct_drafts": 215,
               "spec_num_proposed_drafts": 600, "spec_verify_ct": 40,
               "spec_correct_drafts_histogram": [3, 2, 4, 6, 5, 4, 3, 4, 3, 2, 1, 1, 1, 0, 0, 1]}


def test_request_acceptance_and_summary():
    r = request_acceptance(SGLANG_META)
    assert r.verify_ct == 40 and r.accept_length == 6.4 and sum(r.histogram) == 40
    assert r.tau_from_histogram == pytest.approx(sum((k + 1) * n for k, n in enumerate(r.histogram)) / 40)
    plain = request_acceptance({"completion_tokens": 64, "prompt_tokens": 10})
    assert plain.verify_ct is None and plain.accept_length is None
    other = request_acceptance({"completion_tokens": 100, "spec_verify_ct": 50, "spec_accept_histogram": [50]})
    assert other.accept_length == 2.0
    summary = summarize_requests([r, plain, other])
    assert summary.requests == 3 and summary.tau_mean == pytest.approx((6.4 + 2.0) / 2)
    assert summary.tau_weighted == pytest.approx(356 / 90)
    assert summary.histogram[0] == 53


@pytest.mark.parametrize("bad", [None, {}, {"completion_tokens": "many"},
                                 {"completion_tokens": 3, "spec_correct_drafts_histogram": "x"}])
def test_bad_meta_info(bad):
    with pytest.raises(MetricsError):
        request_acceptance(bad)
