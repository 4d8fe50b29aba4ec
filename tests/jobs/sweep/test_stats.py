"""Statistics on known inputs: percentiles, tau weighting, histograms, ITL accounting, spread."""

import pytest

from ddtree.engine.serving.bench import (RequestResult, _apply_meta, _Stream, merge_histograms, percentile,
                                 point_metrics, spread, tau_stats)


def test_percentile_matches_linear_interpolation():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0


def _req(i, tau, verify, tokens, e2e=1.0, ok=True, error=None):
    return RequestResult(index=i, ok=ok, completion_tokens=tokens, accept_length=tau, verify_ct=verify,
                         e2e_s=e2e, ttft_s=0.1, itl_s=[0.01] * max(tokens - 1, 0), error=error)


def test_tau_mean_and_weighted_by_verify_count():
    reqs = [_req(0, 2.0, 10, 20), _req(1, 4.0, 30, 120), _req(2, None, None, 5, ok=False, error="timeout")]
    mean, weighted = tau_stats(reqs)
    assert mean == 3.0
    assert weighted == pytest.approx((2 * 10 + 4 * 30) / 40)


def test_point_metrics_on_known_requests():
    reqs = [_req(0, 2.0, 10, 20, e2e=2.0), _req(1, 4.0, 30, 120, e2e=4.0),
            _req(2, None, None, 0, ok=False, error="http 500"), _req(3, None, None, 0, ok=False, error="http 500")]
    m = point_metrics(reqs, concurrency=2, duration_s=10.0)
    assert m["requests_ok"] == 2 and m["requests_failed"] == 2
    assert m["output_tokens"] == 140 and m["output_tok_s"] == 14.0 and m["req_s"] == 0.2
    # E2E sums to 8 s over 10 s of wall time: under one request in flight, so per user = total
    assert m["tok_s_per_user"] == 14.0
    assert m["failures"] == {"http 500": 2}
    assert m["e2e_p50"] == 3.0 and m["ttft_p99"] == pytest.approx(0.1)
    assert m["itl_p50"] == pytest.approx(0.01)


def test_histograms_sum_elementwise_and_shift_from_sglang_layout():
    assert merge_histograms([[0, 1, 2], None, [0, 0, 0, 5]]) == [0, 1, 2, 5]
    assert merge_histograms([None, []]) is None
    r = RequestResult(index=0)
    # SGLang: index k = rounds that accepted k drafts; ours: index = accept length (bonus included)
    _apply_meta(r, {"prompt_tokens": 7, "completion_tokens": 12, "spec_verify_ct": 4, "spec_accept_length": 3.0,
                    "spec_accept_histogram": [1, 0, 3], "finish_reason": {"type": "length"}})
    assert r.accept_hist == [0, 1, 0, 3] and r.accept_length == 3.0 and r.verify_ct == 4
    assert r.finish_reason == "length" and r.prompt_tokens == 7
    r2 = RequestResult(index=1)
    _apply_meta(r2, {"completion_tokens": 10, "spec_verify_ct": 4})
    assert r2.accept_length == 2.5


def test_itl_splits_a_multi_token_chunk_evenly():
    r = RequestResult(index=0)
    s = _Stream(r, t0=0.0)
    s.tokens(1, 0.5)      # first token: TTFT
    s.tokens(4, 0.8)      # 3 tokens in one chunk, 0.3 s later
    s.tokens(4, 0.9)      # no new token: ignored
    s.tokens(5, 1.0)
    s.finish(5)
    assert r.ttft_s == 0.5
    assert r.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.2])


def test_itl_when_chunk_sizes_are_unknown_uses_the_final_count():
    r = RequestResult(index=0)
    s = _Stream(r, t0=0.0)
    s.tokens(None, 0.2)
    s.tokens(None, 0.6)
    s.tokens(None, 1.0)
    s.finish(5)  # 4 tokens after the first arrive in 2 chunks
    assert r.itl_s == pytest.approx([0.2, 0.2, 0.2, 0.2])


def test_spread_of_repeats():
    assert spread([10.0, 11.0, 9.0]) == pytest.approx(0.2)
    assert spread([5.0]) is None
