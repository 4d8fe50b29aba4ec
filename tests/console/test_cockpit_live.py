"""End to end from the UI, with real detached jobs and real servers on a tiny random model pair:
an engine started from the form serves /health and stops after a confirmation; a sweep started from
the form lands points and the chart follows."""

from __future__ import annotations

import json

import httpx
import pytest
from .cockpit_support import fixed_sources, table_rows, until

from ddtree.console.app import make_app
from ddtree.console.poll import Sources
from ddtree.console.screens.engines import COLUMNS
from ddtree.console.screens.modals import ConfirmScreen
from ddtree.console.widgets.chart import LineChart
from ddtree.jobs.supervisor import cancel, wait
from ddtree.store import open_db
from ddtree.store.queries import list_jobs

HEALTH, STATE = COLUMNS.index("HEALTH"), COLUMNS.index("STATE")

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "ddtree.db"


def _stop_all(db_path) -> None:
    with open_db(db_path) as db:
        active = [j for j in list_jobs(db) if not j.terminal]
    for job in active:
        try:
            cancel(db_path, job.id, grace_s=5)
        except Exception:  # noqa: BLE001 - cleanup: it may have ended meanwhile
            pass


async def test_engine_from_the_form_serves_then_stops(tiny_pair, db_path):
    target, drafter = tiny_pair
    sources = fixed_sources()
    sources.health, sources.health_s = Sources().health, 1.0  # the real check over HTTP
    app = make_app(db_path, poll_s=0.2, sources=sources)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("4", "n")
            form = app.screen
            form.query_one("#model").value = str(target)
            form.query_one("#draft").value = str(drafter)
            form.query_one("#budget").value = "4"
            # the form checks the fields when it handles their Changed messages: Start once it has
            await until(pilot, lambda: "budget 4," in str(form.query_one("#form-error").render())
                        and not form.query_one("#start").disabled, what="the form taking the pair")
            await pilot.click("#start")
            await until(pilot, lambda: table_rows(app, "engine-table")
                        and table_rows(app, "engine-table")[0][STATE] == "running", timeout=120, what="a running engine")
            rows, _ = app.engines
            url = rows[0]["base_url"]
            assert url.startswith("http://127.0.0.1:") and rows[0]["port"] > 0
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            # The form's backend (auto) resolves to transformers on a CPU; the row keeps what was chosen.
            assert rows[0]["backend"] == "transformers"
            assert table_rows(app, "engine-table")[0][COLUMNS.index("BACKEND")] == "transformers"
            await until(pilot, lambda: table_rows(app, "engine-table")[0][HEALTH] == "ok", what="health ok")
            view = app.query_one("#engine-log")
            await until(pilot, lambda: any('"listening"' in line for line in view.raw_lines), what="the server log")
            await pilot.press("x")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: table_rows(app, "engine-table")[0][STATE] == "stopped", timeout=60,
                        what="the stopped engine")
            job_id = rows[0]["job_id"]
            assert wait(db_path, job_id, timeout=30).state == "cancelled"
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/health", timeout=2)
    finally:
        _stop_all(db_path)


async def test_sweep_from_the_form_lands_points_and_the_chart_follows(tiny_pair, db_path, tmp_path):
    target, drafter = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(4)))
    app = make_app(db_path, poll_s=0.2, sources=fixed_sources())
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("5", "n")
            form = app.screen
            values = {"name": "ui-sweep", "model": str(target), "draft": str(drafter), "budgets": "2, 4",
                      "concurrency": "1", "dataset": str(prompts), "prompts": "2", "tokens": "8", "baseline": "ar"}
            for key, value in values.items():
                form.query_one(f"#f-{key}").value = value
            await until(pilot, lambda: "3 points" in str(form.query_one("#plan").render()), what="the plan")
            await pilot.click("#start")
            chart = app.query_one("#toks-chart", LineChart)
            await until(pilot, lambda: app.points and any(p.state == "done" for p in app.points[1]), timeout=150,
                        what="a landed point")
            await until(pilot, lambda: [s for s in chart.series if not s.reference]
                        and len([s for s in chart.series if not s.reference][0].points) == 2, timeout=150,
                        what="both budgets on the curve")
            run_id = app.points[0]
            assert "ui-sweep" in str(app.query_one("#sweep-title").render())
            with open_db(db_path) as db:
                job_id = db.execute("SELECT job_id FROM runs WHERE id = ?", [run_id]).fetchone()[0]
            assert wait(db_path, job_id, timeout=120).state == "succeeded"
            await until(pilot, lambda: all(r[5] == "done" for r in table_rows(app, "points")), what="all done")
            assert any(s.reference and s.label == "AR" for s in chart.series)
    finally:
        _stop_all(db_path)
