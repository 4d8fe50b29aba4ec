"""History's compare: the per-cell delta table says which differences are significant."""

from types import SimpleNamespace

from ddtree.console.screens.history import delta_table


def _point(algorithm, budget, repeat, tok):
    return SimpleNamespace(state="done", output_tok_s=tok, algorithm=algorithm, budget=budget, repeat=repeat,
                           engine_kind="builtin", tp=1, gpus=[], concurrency=1, dataset="builtin:code",
                           temperature=0.0, baseline=algorithm == "ar", repeat_spread=None, error=None,
                           contended=None, req_s=None, tok_s_per_user=None, tau_mean=None, tau_weighted=None,
                           tau_counters=None, ttft_p50=None, itl_p50=None, e2e_p50=None, e2e_p99=None)


def test_delta_table_names_the_significant_change_and_the_tie():
    runs = [SimpleNamespace(id=1), SimpleNamespace(id=2)]
    points = {1: [_point("ddtree", 16, i, t) for i, t in enumerate((100, 101, 99))]
              + [_point("ddtree", 32, i, t) for i, t in enumerate((90, 95, 85))],
              2: [_point("ddtree", 16, i, t) for i, t in enumerate((120, 121, 119))]
              + [_point("ddtree", 32, i, t) for i, t in enumerate((88, 96, 86))]}
    text = delta_table(runs, points).plain
    assert "run 2 against run 1" in text
    row16 = next(line for line in text.splitlines() if line.split()[:2] == ["ddtree", "16"])
    row32 = next(line for line in text.splitlines() if line.split()[:2] == ["ddtree", "32"])
    assert "+20.0%" in row16 and row16.endswith("faster")
    assert row32.endswith("tie within noise")
    assert "no grid cell in common" in delta_table(runs, {1: points[1], 2: []}).plain
