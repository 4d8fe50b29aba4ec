"""store/stats.py on known numbers: the t table, summaries, paired ratios, the best-budget verdict."""

import math

import pytest

from ddtree.store.stats import Summary, paired_ratio, summary, t975, verdict


def test_t_quantiles_match_published_values():
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(30) == 2.042
    # beyond the table: the series against the exact values (scipy.stats.t.ppf(0.975, df))
    for df, exact in ((31, 2.0395134), (40, 2.0210754), (60, 2.0002978), (120, 1.9799304), (1000, 1.9623391)):
        assert t975(df) == pytest.approx(exact, abs=2e-4)
    with pytest.raises(ValueError):
        t975(0)


def test_summary_of_known_values():
    s = summary([10.0, 12.0, 14.0, None])
    assert s.n == 3 and s.mean == 12.0 and s.median == 12.0
    assert s.sd == pytest.approx(2.0)
    half = 4.303 * 2.0 / math.sqrt(3)
    assert (s.ci_low, s.ci_high) == (pytest.approx(12.0 - half), pytest.approx(12.0 + half))
    assert s.cv == pytest.approx(2.0 / 12.0)
    assert (s.low, s.high) == (10.0, 14.0)


def test_summary_of_one_or_no_value_has_no_interval():
    one = summary([5.0])
    assert one.n == 1 and one.mean == 5.0 and one.median == 5.0
    assert one.sd is None and not one.has_interval and one.cv is None
    assert summary([]).n == 0 and summary([]).mean is None


def test_paired_ratio_is_the_geometric_mean_with_a_log_interval():
    # repeat 0 at 2x, repeat 1 at 2x, repeat 2 at 2x: no spread, interval collapses onto 2
    r = paired_ratio({0: 20.0, 1: 30.0, 2: 40.0}, {0: 10.0, 1: 15.0, 2: 20.0})
    assert r.value == pytest.approx(2.0) and r.n == 3 and r.paired
    assert r.ci_low == pytest.approx(2.0) and r.ci_high == pytest.approx(2.0)
    # pairing matters: unpaired, these rates spread widely; paired, each repeat is exactly 2x
    r = paired_ratio({0: 2.0, 1: 8.0}, {0: 1.0, 1: 2.0})
    logs = [math.log(2.0), math.log(4.0)]
    mean = sum(logs) / 2
    sd = abs(logs[1] - logs[0]) / math.sqrt(2)
    half = 12.706 * sd / math.sqrt(2)
    assert r.value == pytest.approx(math.sqrt(8.0))
    assert r.ci_low == pytest.approx(math.exp(mean - half)) and r.ci_high == pytest.approx(math.exp(mean + half))


def test_paired_ratio_without_matching_repeats_falls_back_to_medians():
    r = paired_ratio({1: 30.0}, {0: 10.0})
    assert r.value == pytest.approx(3.0) and not r.paired and r.ci_low is None
    assert paired_ratio({}, {0: 1.0}).value is None


def _s(*values):
    return summary(values)


def test_verdict_best_only_when_the_interval_clears_the_runner_up():
    v = verdict([(8, _s(100, 101, 99)), (16, _s(130, 131, 129)), (32, _s(110, 111, 109))])
    assert v.state == "best" and v.best == 16
    assert v.text.startswith("best budget 16 at 130.0 tok/s")


def test_verdict_tie_names_every_budget_within_noise():
    # the case: one lucky sample at 16 does not beat 8 and 32 when the repeats overlap
    v = verdict([(4, _s(80, 81, 79)), (8, _s(106, 110, 102)), (16, _s(120, 107, 105)), (32, _s(109, 108, 110))])
    assert v.state == "tie" and v.best is None
    assert v.tied[0] == 16 and set(v.tied) == {16, 8, 32}
    assert v.text.startswith("tie within noise: budgets 16, ")
    # a wild repeat widens the leader's interval over everything, and flags it unstable
    v = verdict([(4, _s(80, 81, 79)), (16, _s(177, 107, 105))])
    assert v.state == "tie" and v.tied == (16, 4)
    assert v.unstable == (16,) and v.note == "unstable (CV > 10%): budgets 16"
    assert v.full == "tie within noise: budgets 16, 4; unstable (CV > 10%): budgets 16"


def test_verdict_without_repeats_is_untested_not_best():
    v = verdict([(8, _s(106.6)), (16, _s(177.0))])
    assert v.state == "untested" and v.best == 16 and "untested" in v.text and "best" not in v.text
    assert v.short == "16? untested"
    assert verdict([]).state == "none"
    assert verdict([(8, _s(1.0, 1.1))]).state == "single"
    assert verdict([(8, Summary(0))]).state == "none"
