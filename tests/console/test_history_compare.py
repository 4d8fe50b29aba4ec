"""History's compare view against History itself: the points count is the one History shows for
the same run, and the settings cells (software versions, hardware) are wrapped, never cut."""

from __future__ import annotations

import pytest

from .cockpit_support import NOW, fixed_sources, on_screen, seed_store, table_rows, until

from ddtree.console.app import make_app
from ddtree.console.screens.history import COLUMNS, CompareScreen, compare_tables
from ddtree.store import open_db, sweeps

pytestmark = pytest.mark.timeout(60)

SOFTWARE = {"python": "3.11.9", "packages": {"torch": "2.13.0+cu130", "transformers": "5.24.0",
                                            "sglang": "0.5.23.post1", "vllm": "0.19.2rc1.dev42"}}


def _lines_of(text: str, key: str) -> list[str]:
    """The lines of `key`'s row in a compare table: its own and the wrapped ones under it."""
    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(key + " "))
    rows = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * 17):
            break
        rows.append(line)
    return rows


def _words_of(lines: list[str]) -> set[str]:
    return {w for line in lines for w in line[17:].split()}


async def test_compare_counts_points_as_history_does_and_wraps_the_software(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    old, prev = ids["old_run"], ids["prev_run"]
    with open_db(db_path) as db:
        sweeps.update_run(db, prev, software=SOFTWARE)
        # a failed point: History counts done points only, and so must compare
        point = next(p for p in sweeps.list_points(db, old) if p.algorithm == "ddtree")
        sweeps.record_point(db, point.id, state="failed", metrics={}, requests=[], error="engine died")
    app = make_app(db_path, poll_s=0.1, clock=lambda: NOW, sources=fixed_sources())
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: len(table_rows(app, "runs")) == 3, what="the runs")
        col = COLUMNS.index("POINTS")
        history = {int(r[0]): r[col] for r in table_rows(app, "runs")}
        assert history[old] == "6/7" and history[prev] == "7/7"  # 5 budgets + the AR and DFlash baselines
        app.query_one("#history").marked = {old, prev}
        await pilot.press("c")
        await until(pilot, lambda: on_screen(app, CompareScreen), what="the comparison")
        metrics = str(app.screen.query_one("#metrics").render())
        done = _lines_of(metrics, "points done")
        assert len(done) == 1 and done[0][17:].split() == [history[old], history[prev]]
        settings = str(app.screen.query_one("#settings").render())
    software = _lines_of(settings, "software")
    assert len(software) > 1  # wrapped onto more lines, not cut
    assert {"torch=2.13.0+cu130", "transformers=5.24.0", "sglang=0.5.23.post1",
            "vllm=0.19.2rc1.dev42"} <= _words_of(software)
    assert {"torch=2.13.0", "transformers=5.24.0"} <= _words_of(software)  # the other run's, whole too
    assert "…" not in settings


def test_wrapped_settings_keep_their_columns():
    """Each run's cell stays in its own column however many lines its neighbour wraps to."""
    from types import SimpleNamespace

    def run(rid, software):
        return SimpleNamespace(id=rid, recipe={}, engine_kind="builtin", model="m", draft_model="d", hardware=None,
                               software=software, points_done=3, points_total=None)

    runs = [run(1, SOFTWARE), run(2, {"packages": {"torch": "2.13.0"}})]
    settings, metrics, _ = compare_tables(runs, {1: [], 2: []})
    lines = _lines_of(settings.plain, "software")
    width = len(settings.plain.splitlines()[0]) - 17  # the header: 'setting' then a column per run
    column = width // 2
    assert lines[0][17 + column:].split() == ["torch=2.13.0"]
    assert all(not line[17 + column:].strip() for line in lines[1:])
    assert _lines_of(metrics.plain, "points done")[0][17:].split() == ["3", "3"]
