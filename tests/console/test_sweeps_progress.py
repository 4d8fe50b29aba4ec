"""The Sweeps pane at 80x24 (issue 17): the point in progress stays on screen, the header shows
the progress and an ETA from measured point times that counts down on a clock the test moves."""

from __future__ import annotations

import pytest

from ..store.insight_support import point
from .cockpit_support import NOW, fixed_sources, seed_store, table_rows, text_of, until

from ddtree.console.app import make_app
from ddtree.console.screens.sweeps import insight_text, point_in_progress
from ddtree.store import open_db
from ddtree.store.queries import update_row

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def visible(table, index: int) -> bool:
    """Is row `index` on screen (the header takes the table's first line)?"""
    top = table.scroll_offset.y
    return top + 1 <= index + 1 < top + table.size.height


async def test_point_in_progress_is_on_screen_and_the_eta_counts_down(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    clock = Clock()
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=clock)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: len(table_rows(app, "points")) == 14, what="the points")
        table = app.query_one("#points")
        # nine points done (25 s each), five to go: point 10 is next, below the first rows
        assert table.size.height < 11
        await until(pilot, lambda: visible(table, 9), what="point 10 scrolled into view")
        assert "9/14 points, ETA 2m05s" in text_of(app, "sweep-title")

        # the user scrolls back up: a poll that changes nothing leaves the table where they put it
        table.scroll_home(animate=False, immediate=True)
        pane = app.query_one("#sweeps")
        pane.show(app.points)
        await pilot.pause()
        assert table.scroll_offset.y == 0

        with open_db(db_path) as db:
            point = db.execute("SELECT id FROM points WHERE run_id = ? AND idx = 9", [ids["live_run"]]).fetchone()[0]
            update_row(db, "points", point, {"state": "running", "started_at": NOW - 10})
        # 4 to go at 25 s plus the 15 s left of the running one
        await until(pilot, lambda: "ETA 1m55s" in text_of(app, "sweep-title"), what="the ETA with a point running")
        clock.t += 5  # the store does not change; the header still counts down
        await until(pilot, lambda: "ETA 1m50s" in text_of(app, "sweep-title"), what="the ETA tick")


def test_the_point_in_progress_is_the_running_one_else_the_next():
    class P:
        def __init__(self, state):
            self.state = state

    assert point_in_progress([P("done"), P("pending"), P("running")]) == 2
    assert point_in_progress([P("done"), P("failed"), P("pending")]) == 2
    assert point_in_progress([P("done"), P("skipped")]) is None


def test_failures_are_counted_in_words():
    failed = point("ddtree", 8, 0, None, state="failed")
    failed.error = "engine died"
    assert "1 point failed: engine died" in str(insight_text([failed]))
    assert "2 points failed" in str(insight_text([failed, failed]))


async def test_a_cancelled_run_says_it_ended_with_its_points_so_far(tmp_path):
    """A run cancelled after its baselines: the charts no longer wait for a first point, the points
    it will not measure say "not run", and the Overview does not read as a cancel still pending."""
    from ddtree.jobs.model import create_job, set_state
    from ddtree.store import sweeps

    from .cockpit_support import demo_recipe, seed_run

    db_path = tmp_path / "ddtree.db"
    with open_db(db_path) as db:
        job = create_job(db, "sweep", {"run_id": 1}, name="cut-short")
        set_state(db, job, "starting")
        set_state(db, job, "running")
        set_state(db, job, "cancelled", "cancel requested")
        run = seed_run(db, demo_recipe("cut-short", budgets=(4, 8), concurrency=(1,)), done=2, job_id=job,
                       created=NOW - 60, state="running")
        sweeps.finish_run(db, run, "cancelled")
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=Clock())
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.snapshot is not None and app.snapshot.jobs, what="the jobs")
        await until(pilot, lambda: "stopped on request" in str(table_rows(app, "jobs")), what="the job's end")
        assert "cancel requested" not in str(table_rows(app, "jobs"))
        await pilot.press("5")
        await until(pilot, lambda: len(table_rows(app, "points")) == 4, what="the points")
        tau = app.query_one("#tau-chart")
        await until(pilot, lambda: "cancelled before a DDTree point" in str(tau.as_text()), what="the charts' note")
        assert "waiting" not in str(app.query_one("#toks-chart").as_text())
        assert "(2/4 points done" in str(tau.as_text())
        assert "(cancelled) 2/4 points" in text_of(app, "sweep-title")
        states = [row[5] for row in table_rows(app, "points")]
        assert states == ["done", "done", "not run", "not run"]
        # at 60 columns a chart is 30 wide: the note breaks between words, none is cut at the edge
        await pilot.resize_terminal(60, 20)
        await until(pilot, lambda: tau.size.width < 32, what="the narrow charts")
        await pilot.pause()
        words = str(tau.as_text()).split()
        assert "point" in words and "DDTree" in words and "done," in words
        assert all(len(line) <= tau.size.width for line in str(tau.as_text()).splitlines())


def test_the_charts_note_of_a_run_that_finished_without_a_ddtree_point_does_not_say_it_stopped():
    """A run that ended early says so; one that finished its plan (dflash and ar only, say) has no
    DDTree point to draw, and 'succeeded before a DDTree point' read as cut short."""
    from types import SimpleNamespace as Run

    from ddtree.console.screens.sweeps import WAITING, chart_empty_text

    assert chart_empty_text(Run(state="running", points_done=1, points_total=4)) == WAITING
    assert chart_empty_text(Run(state="cancelled", points_done=0, points_total=4)) == \
        "run cancelled before its first point"
    assert chart_empty_text(Run(state="cancelled", points_done=2, points_total=4)) == \
        "run cancelled before a DDTree point\n(2/4 points done, below)"
    finished = chart_empty_text(Run(state="succeeded", points_done=3, points_total=3))
    assert "before" not in finished and "no DDTree point" in finished and "(3/3 points done, below)" in finished
    assert "before" not in chart_empty_text(Run(state="succeeded", points_done=0, points_total=0))
