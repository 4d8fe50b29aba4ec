"""Every figure of README.md's Metrics section, computed from known per-request rows.

Each test builds the rows a sweep would record (what the client saw of each request, and SGLang's
meta_info) and checks engine/bench.point_metrics against the definition worked out by hand."""

import pytest

from ddtree.engine.serving.bench import RequestResult, _apply_meta, point_metrics


def _row(i, *, start, e2e, tokens, ttft=0.1, itl=None, accept=None, verify=None, ok=True):
    return RequestResult(index=i, ok=ok, completion_tokens=tokens, start_offset_s=start, e2e_s=e2e, ttft_s=ttft,
                         itl_s=list(itl or []), accept_length=accept, verify_ct=verify,
                         error=None if ok else "http 500")


# Concurrency 1: one short request and one long one back to back, 0.5 s of client gap between.
SEQUENTIAL = [_row(0, start=0.0, e2e=0.5, tokens=50), _row(1, start=1.0, e2e=9.0, tokens=135)]
# Concurrency 2: two requests wholly overlapped over 4 s.
OVERLAPPED = [_row(0, start=0.0, e2e=4.0, tokens=100), _row(1, start=0.0, e2e=4.0, tokens=60)]


def test_output_tok_s_is_completion_tokens_over_wall_time():
    m = point_metrics(SEQUENTIAL, concurrency=1)
    assert m["duration_s"] == 10.0  # first start 0 s to last end 1 + 9 s
    assert m["output_tok_s"] == pytest.approx(185 / 10.0)
    assert m["req_s"] == pytest.approx(0.2)


def test_per_user_tok_s_never_exceeds_output_tok_s_at_concurrency_one():
    m = point_metrics(SEQUENTIAL, concurrency=1)
    # the old mean of tokens/E2E: (100 + 15) / 2 = 57.5 tok/s against 18.5 total; now: equal
    assert m["tok_s_per_user"] == pytest.approx(m["output_tok_s"])


def test_per_user_tok_s_shares_output_among_requests_in_flight():
    m = point_metrics(OVERLAPPED, concurrency=2)
    assert m["output_tok_s"] == pytest.approx(160 / 4.0)
    # mean in flight = (4 + 4) / 4 = 2 requests
    assert m["tok_s_per_user"] == pytest.approx(160 / 4.0 / 2)


def test_failed_requests_count_against_throughput_but_not_its_tokens():
    rows = [_row(0, start=0.0, e2e=2.0, tokens=40), _row(1, start=2.0, e2e=2.0, tokens=0, ok=False)]
    m = point_metrics(rows, concurrency=1)
    assert m["output_tok_s"] == pytest.approx(40 / 4.0) and m["requests_failed"] == 1
    assert m["tok_s_per_user"] == pytest.approx(40 / 4.0)


def test_ttft_itl_and_e2e_percentiles():
    rows = [_row(0, start=0.0, e2e=1.0, tokens=3, ttft=0.2, itl=[0.4, 0.4]),
            _row(1, start=1.0, e2e=2.0, tokens=3, ttft=0.6, itl=[0.6, 0.8])]
    m = point_metrics(rows, concurrency=1)
    assert m["ttft_p50"] == pytest.approx(0.4)  # between 0.2 and 0.6
    assert m["itl_p50"] == pytest.approx(0.5)  # over every gap of every request: 0.4 0.4 0.6 0.8
    assert m["e2e_p50"] == pytest.approx(1.5) and m["e2e_p99"] == pytest.approx(1.99)


def test_spec_accept_length_from_sglang_meta_info_is_tokens_per_verify_round():
    r = RequestResult(index=0)
    _apply_meta(r, {"completion_tokens": 30, "spec_verify_ct": 10})
    assert r.accept_length == 3.0 and r.verify_ct == 10


def test_tau_mean_per_request_against_tau_weighted_by_verify_count():
    # a short request accepting 5 per round and a long one accepting 2 per round
    rows = [_row(0, start=0.0, e2e=1.0, tokens=10, accept=5.0, verify=2),
            _row(1, start=1.0, e2e=1.0, tokens=100, accept=2.0, verify=50)]
    m = point_metrics(rows, concurrency=1)
    assert m["tau_mean"] == pytest.approx(3.5)  # (5 + 2) / 2: each request counts once
    assert m["tau_weighted"] == pytest.approx(110 / 52)  # all tokens over all verify rounds
