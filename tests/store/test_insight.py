"""The budget recommender on synthetic sweeps with known answers, and the acceptance grids."""

import pytest

from ddtree.store.insight import (MIN_REPEATS, RepeatAsk, acceptance_grids, budget_span, merged_histogram,
                                  recommend, serving_comment, serving_settings)

from .insight_support import point, points

BASE = {("ar", None): [50, 50.5, 49.5], ("dflash", None): [80, 81, 79]}


def test_a_clear_winner_is_served_with_its_gains():
    pts = points({**BASE, ("ddtree", 8): [90, 91, 89], ("ddtree", 16): [120, 121, 119], ("ddtree", 32): [100, 101, 99]})
    [rec] = recommend(pts)
    assert rec.state == "clear" and rec.decided and rec.budget == 16 and rec.tied == (16,)
    assert rec.more == ()
    ar, dflash = rec.ratios["ar"], rec.ratios["dflash"]
    assert ar.value == pytest.approx(2.4, rel=0.01) and ar.ci_low < ar.value < ar.ci_high
    assert dflash.value == pytest.approx(1.5, rel=0.01)
    assert "serve budget 16" in rec.text and "AR" in rec.text and "DFlash" in rec.text
    assert rec.line.startswith("serve budget 16 at 120.0 tok/s (2.40x [")


def test_a_tie_within_the_margin_serves_the_smallest_budget():
    pts = points({**BASE, ("ddtree", 8): [90, 91, 89], ("ddtree", 16): [119, 120, 121],
                  ("ddtree", 32): [120, 121, 119.5], ("ddtree", 64): [120.5, 121, 120]})
    [rec] = recommend(pts)
    assert rec.state == "tie" and rec.decided
    assert rec.budget == 16 and rec.best == 64 and rec.tied == (16, 32, 64)
    assert "budgets 16-64 that tie within 5%" in rec.text
    assert rec.more == ()


def test_a_noisy_set_asks_for_the_repeats_that_would_decide_it():
    pts = points({**BASE, ("ddtree", 8): [90, 91, 89], ("ddtree", 16): [100, 130, 115],
                  ("ddtree", 32): [95, 140, 120], ("ddtree", 64): [110, 135, 100]})
    [rec] = recommend(pts)
    assert rec.state == "undecided" and not rec.decided
    assert rec.budget == 8 and rec.best == 32 and rec.tied == (8, 16, 32, 64)
    assert "budgets 8-64 tie; measure more repeats" in rec.text
    asks = {a.budget: a for a in rec.more}
    assert set(asks) == {8, 16, 32, 64}
    assert all(a.have == 3 and a.want > 3 and a.extra == a.want - 3 for a in asks.values())
    assert all(a.cell_key for a in asks.values())  # what a queue of extra repeats needs


def test_single_repeats_are_untested_and_ask_for_three():
    [rec] = recommend(points({("ddtree", 8): [90], ("ddtree", 16): [100, 101]}))
    assert rec.state == "untested" and rec.budget == 16 and not rec.decided
    assert [(a.budget, a.have, a.want) for a in rec.more] == [(8, 1, MIN_REPEATS), (16, 2, MIN_REPEATS)]


def test_each_concurrency_gets_its_own_recommendation_and_nothing_measured_none():
    pts = (points({("ddtree", 8): [90, 91, 89], ("ddtree", 16): [120, 121, 119]}, concurrency=1)
           + points({("ddtree", 8): [200, 201, 199], ("ddtree", 16): [150, 151, 149]}, concurrency=4)
           + points({("ar", None): [40, 41, 39]}, concurrency=8))
    recs = recommend(pts)
    assert [(r.setting["concurrency"], r.budget) for r in recs] == [(1, 16), (4, 8)]
    rows = serving_settings(pts)
    assert [(r["label"], r["budget"], r["decided"]) for r in rows] == [("c=1", 16, True), ("c=4", 8, True)]
    assert "c=4: budget = 8" in serving_comment(pts)


def test_failed_and_pending_points_do_not_count():
    pts = points({("ddtree", 8): [90, 91, 89], ("ddtree", 16): [120, 121, 119]})
    pts.append(point("ddtree", 32, 0, 500.0, state="failed"))
    pts.append(point("ddtree", 64, 0, None, state="pending"))
    [rec] = recommend(pts)
    assert rec.budget == 16 and rec.measured == (8, 16)


def test_budget_span_and_repeat_ask():
    assert budget_span([16, 32, 64], [8, 16, 32, 64]) == "16-64"
    assert budget_span([8, 32], [8, 16, 32]) == "8, 32"
    assert RepeatAsk(16, 3, 8).extra == 5
    with pytest.raises(ValueError):
        RepeatAsk(16, 5, 3)


def test_acceptance_grid_shares_from_known_histograms():
    # index = accepted length per round (the bonus token included); index 0 is never used
    pts = [point("ddtree", 8, 0, 90, hist=[0, 2, 2]), point("ddtree", 8, 1, 91, hist=[0, 2, 2, 0]),
           point("ddtree", 32, 0, 100, hist=[0, 1, 1, 2, 4]), point("dflash", None, 0, 80, hist=[0, 4]),
           point("ar", None, 0, 50, hist=None)]
    [grid] = acceptance_grids(pts)
    assert grid.lengths == (1, 2, 3, 4)
    assert [r.label for r in grid.rows] == ["DFlash", "8", "32"]
    assert grid.share("8", 1) == 0.5 and grid.share("8", 2) == 0.5 and grid.share("8", 4) == 0
    assert grid.share("32", 4) == 0.5 and grid.share("DFlash", 1) == 1.0
    row32 = grid.rows[2]
    assert row32.rounds == 8 and row32.mean == pytest.approx((1 + 2 + 6 + 16) / 8)
    assert merged_histogram([[0, 1], None, "bad", [0, 0, 3]]) == [0, 1, 3]


def test_acceptance_grids_per_concurrency_and_none_without_histograms():
    pts = [point("ddtree", 8, 0, 90, hist=[0, 1, 3], concurrency=1),
           point("ddtree", 8, 0, 150, hist=[0, 3, 1], concurrency=4), point("ddtree", 16, 0, 99, concurrency=8)]
    grids = acceptance_grids(pts)
    assert [g.label for g in grids] == ["c=1", "c=4"]
    assert grids[1].share("8", 1) == 0.75
