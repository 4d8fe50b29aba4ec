"""Comparing two runs cell by cell: deltas with both intervals, and whether they are significant."""

from types import SimpleNamespace

from ddtree.store.summary import compare_cells


def _point(algorithm, budget, repeat, tok, concurrency=1):
    return SimpleNamespace(state="done", output_tok_s=tok, algorithm=algorithm, budget=budget, repeat=repeat,
                           engine_kind="builtin", tp=1, gpus=[], concurrency=concurrency, dataset="builtin:code",
                           temperature=0.0, baseline=algorithm == "ar", repeat_spread=None, error=None,
                           contended=None, req_s=None, tok_s_per_user=None, tau_mean=None, tau_weighted=None,
                           tau_counters=None, ttft_p50=None, itl_p50=None, e2e_p50=None, e2e_p99=None)


def _run(cells: dict) -> list:
    return [_point(alg, budget, i, tok) for (alg, budget), toks in cells.items() for i, tok in enumerate(toks)]


def test_a_clear_change_is_significant_and_a_wobble_is_a_tie():
    base = _run({("ar", None): [50, 51, 49], ("ddtree", 16): [100, 101, 99], ("ddtree", 32): [90, 95, 85]})
    other = _run({("ar", None): [50.5, 49.5, 50], ("ddtree", 16): [120, 121, 119], ("ddtree", 32): [88, 96, 86]})
    rows = {(r["algorithm"], r["budget"]): r for r in compare_cells(base, other)}
    assert rows[("ddtree", 16)]["verdict"] == "faster" and rows[("ddtree", 16)]["significant"]
    assert round(rows[("ddtree", 16)]["delta_pct"]) == 20
    assert rows[("ddtree", 32)]["verdict"] == "tie within noise" and not rows[("ddtree", 32)]["significant"]
    assert rows[("ar", None)]["verdict"] == "tie within noise"
    assert rows[("ddtree", 16)]["base"]["ci_low"] < 100 < rows[("ddtree", 16)]["base"]["ci_high"]


def test_one_repeat_is_untested_and_missing_cells_are_left_out():
    base = _run({("ddtree", 16): [100], ("ddtree", 64): [70, 71]})
    other = _run({("ddtree", 16): [130], ("ddtree", 8): [60, 61]})
    rows = compare_cells(base, other)
    assert [(r["budget"], r["verdict"]) for r in rows] == [(16, "untested")]
    slower = compare_cells(_run({("ddtree", 64): [70, 71, 70]}), _run({("ddtree", 64): [50, 51, 50]}))
    assert slower[0]["verdict"] == "slower" and slower[0]["delta_pct"] < 0
