"""The History pane at 80x24 and 120x40 (issue 17): every column, CREATED and FLAGS included,
and the filter's hint fit; a run of the demo pair shows its model as demo/target."""

from __future__ import annotations

import pytest

from .cockpit_support import NOW, fixed_sources, seed_store, table_rows, until, utc  # noqa: F401  (a fixture)

from ddtree.console.app import make_app
from ddtree.console.screens.history import COLUMNS, NARROW_COLUMNS, run_cells
from ddtree.store import open_db
from ddtree.store.queries import insert_row

pytestmark = pytest.mark.timeout(60)

@pytest.fixture(autouse=True)
def in_utc(utc):
    """Every test here draws its timestamps in UTC."""

def test_a_run_without_a_model_ran_the_demo_pair():
    row = {"id": 7, "name": "demo-budgets", "engine_kind": "builtin", "model": None, "state": "succeeded",
           "points_done": 6, "points_total": 6, "best": 80.0, "created_at": NOW}
    assert run_cells(row, False)[3] == "demo/target"
    assert run_cells({**row, "model": "demo"}, False)[3] == "demo/target"  # the engines table's record
    narrow = run_cells(row, False, narrow=True)
    assert len(narrow) == len(NARROW_COLUMNS) and narrow[2] == "demo/target"
    assert narrow[NARROW_COLUMNS.index("CREATED")] == "09-21 14:13"
    assert run_cells(row, False)[COLUMNS.index("CREATED")] == "2026-09-21 14:13"

@pytest.mark.parametrize("size, stamp", [((80, 24), "09-21 14:03"), ((120, 40), "2026-09-21 14:03")])
async def test_every_column_and_the_filter_hint_fit(tmp_path, size, stamp):
    db_path = tmp_path / "ddtree.db"
    seed_store(db_path)
    with open_db(db_path) as db:
        insert_row(db, "runs", {"name": "demo-budgets", "engine_kind": "builtin", "model": None, "state": "succeeded",
                                "points_total": 6, "created_at": NOW - 60})
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=size) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: len(table_rows(app, "runs")) == 4, what="the runs")
        table = app.query_one("#runs")
        rows = table_rows(app, "runs")
        columns = NARROW_COLUMNS if size[0] < 100 else COLUMNS
        assert [r[columns.index("CREATED")] for r in rows][1] == stamp
        assert rows[0][columns.index("MODEL")] == "demo/target"
        assert table.virtual_size.width <= table.scrollable_content_region.width  # FLAGS on screen too
        box = app.query_one("#history-filter")
        assert box.content_region.width >= len(box.placeholder)  # the whole hint shows
        assert "__editable__" not in " ".join(" ".join(r) for r in rows)


@pytest.mark.parametrize("width", [60, 66, 72])
async def test_the_filter_hint_shortens_to_fit_a_narrow_terminal(tmp_path, width):
    db_path = tmp_path / "ddtree.db"
    seed_store(db_path)
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(width, 24)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: table_rows(app, "runs"), what="the runs")
        box = app.query_one("#history-filter")
        await until(pilot, lambda: box.content_region.width >= len(box.placeholder), what="a hint that fits")
        assert box.placeholder.startswith("/")
