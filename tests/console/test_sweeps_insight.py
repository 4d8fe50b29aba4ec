"""The Sweeps pane names the budget to serve with, flags a regression against earlier runs of the
same fingerprint, and swaps its charts for the acceptance heatmap on h."""

from __future__ import annotations

import pytest

from ddtree.console.app import make_app
from ddtree.store import open_db

from ..store.sentinel_support import SOFTWARE, store_run
from .cockpit_support import NOW, fixed_sources, on_screen, table_rows, text_of, until

pytestmark = pytest.mark.timeout(60)


def _app(db_path):
    return make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)


async def test_the_pane_shows_the_recommendation_and_the_heatmap(tmp_path):
    db_path = tmp_path / "ddtree.db"
    with open_db(db_path) as db:
        store_run(db)
    app = _app(db_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: len(table_rows(app, "points")) == 15, what="the points")
        await until(pilot, lambda: "serve" in text_of(app, "best"), what="the recommendation")
        best = text_of(app, "best")
        # budgets 32 (120 tok/s) is clear of 64 (115) and the rest: serve it, 2.40x AR
        assert "c=1: serve budget 32 at 120.0 tok/s (2.40x [" in best and "clear of the rest" in best
        assert not app.query_one("#heatmap").display and not app.query_one("#sentinel").display
        await pilot.press("h")
        assert app.query_one("#heatmap").display and not app.query_one("#charts").display
        heat = text_of(app, "heatmap-body")
        assert "c=1: accepted length per round" in heat and "budget" in heat
        await pilot.press("h")
        assert app.query_one("#charts").display and not app.query_one("#heatmap").display
        await pilot.press("h", "escape")  # Escape leaves the heatmap too
        assert app.query_one("#charts").display and not app.query_one("#heatmap").display
        await pilot.press("escape")  # and only leaves it: it does not bring it back
        assert app.query_one("#charts").display and not app.query_one("#heatmap").display


async def test_the_pane_flags_a_run_slower_than_its_history(tmp_path):
    db_path = tmp_path / "ddtree.db"
    with open_db(db_path) as db:
        for i in range(3):
            store_run(db, scale=1 + 0.01 * (i - 1))
        store_run(db, scale=0.8, software={**SOFTWARE, "packages": {**SOFTWARE["packages"], "torch": "2.14.0"}})
    app = _app(db_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: app.query_one("#sentinel").display, what="the flag")
        flags = text_of(app, "sentinel").splitlines()
        assert flags[0].startswith("⚠ c=1: budgets 8-64 20% slower than the last 3 runs")
        assert flags[1].startswith("⚠ c=1: AR 20% slower") and "torch 2.13.0 -> 2.14.0" in flags[2]
        assert "c=1: serve budget 32" in text_of(app, "best")


async def test_history_flags_the_slow_run_and_its_detail_says_why(tmp_path):
    from ddtree.console.screens.rundetail import RunScreen

    db_path = tmp_path / "ddtree.db"
    with open_db(db_path) as db:
        fine = [store_run(db, scale=1 + 0.01 * (i - 1)) for i in range(3)]
        slow = store_run(db, scale=0.8)
    app = _app(db_path)
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: len(table_rows(app, "runs")) == 4, what="the runs")

        def flags() -> dict:
            return {row[0]: row[-1] for row in table_rows(app, "runs")}
        await until(pilot, lambda: flags()[str(slow)].startswith("⚠"), what="the flag")
        assert flags()[str(slow)].startswith("⚠ c=1: budgets 8-64 20% slower than the last 3")
        assert flags()[str(fine[0])] == "" and flags()[str(fine[2])] == "ok vs 2"
        app.open_run(slow)
        await until(pilot, lambda: on_screen(app, RunScreen), what="the run")
        await until(pilot, lambda: "against runs" in str(app.screen.query_one("#run-sentinel").render()),
                    what="the sentinel")
        text = str(app.screen.query_one("#run-sentinel").render())
        assert f"against runs {fine[2]}, {fine[1]}, {fine[0]}" in text and "⚠ c=1: budgets 8-64 20% slower" in text
        assert "serve budget 32" in str(app.screen.query_one("#run-recommendation").render())
        assert "accepted length per round" in str(app.screen.query_one("#run-heatmap").render())
