"""The History pane's query (store.queries.runs_page) and its use by the pane."""

from __future__ import annotations

import json

import pytest
from .cockpit_support import NOW, fixed_sources, table_rows, until

from ddtree.console.app import make_app
from ddtree.store import open_db, transaction
from ddtree.store.queries import RUN_ORDERS, runs_page

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def db(tmp_path):
    db = open_db(tmp_path / "ddtree.db")
    names = ["Qwen3-8B sweep", "qwen3_8b_sweep", "100% budget", "kimi", None]
    with transaction(db):
        for i, name in enumerate(names, 1):
            db.execute("INSERT INTO runs (id, name, model, engine_kind, state, recipe, created_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)",
                       [i, name, "moonshotai/Kimi-K2.6" if name == "kimi" else None, "sglang", "succeeded",
                        json.dumps({"sweep": {"dataset": f"set-{i}"}}), 1000.0 + i])
        for run_id, budget, tok_s in ((1, 4, 10.0), (1, 16, 30.0), (2, 4, 20.0), (3, 4, None)):
            db.execute("INSERT INTO points (run_id, algorithm, budget, state, output_tok_s) "
                       "VALUES (?, 'ddtree', ?, 'done', ?)", [run_id, budget, tok_s])
        db.execute("INSERT INTO points (run_id, state, output_tok_s) VALUES (2, 'failed', 99.0)")
    yield db
    db.close()


def ids(page):
    return [row["id"] for row in page[0]]


def test_text_is_a_literal_case_insensitive_substring_of_the_shown_fields_and_the_recipe(db):
    assert ids(runs_page(db, "QWEN3")) == [2, 1]
    assert ids(runs_page(db, "_8b_")) == [2]  # "_" is not a wildcard
    assert ids(runs_page(db, "100%")) == [3]  # nor is "%"
    assert ids(runs_page(db, "%")) == [3]
    assert ids(runs_page(db, "kimi-k2.6")) == [4]  # the model column
    assert ids(runs_page(db, "set-5")) == [5]  # inside the recipe JSON; the NULL name does not hurt
    assert ids(runs_page(db, "  ")) == [5, 4, 3, 2, 1]
    assert ids(runs_page(db, "nothing like it")) == []



def test_the_pane_finds_demo_pair_runs_by_the_name_it_shows_them_by(db):
    """Runs recorded without a model ran the demo pair and show "demo/target": typing that finds them."""
    from ddtree.console.screens.history import load_runs

    assert ids(load_runs(db, "demo/target")) == [5, 3, 2, 1]  # all but kimi, which names its model
    assert ids(load_runs(db, "DRAFTER")) == [5, 3, 2, 1]
    assert ids(load_runs(db, "qwen3")) == [2, 1]  # other text: as before


def test_best_is_the_highest_cell_median_that_runs_and_the_exports_quote(tmp_path):
    """With repeats, BEST TOK/S is the best cell's median over its done repeats (the exports' "out
    tok/s (median)"), not the luckiest single repeat, which no other view shows."""
    from ddtree.store.summary import cell_rows
    from ddtree.store.sweeps import list_points

    db = open_db(tmp_path / "ddtree.db")
    repeats = {("ar", None, 1): [90.0, 95.0, 92.0], ("ddtree", 4, 1): [100.0, 180.0, 110.0],
               ("ddtree", 16, 1): [150.0, 160.0, 155.0], ("ddtree", 16, 2): [140.0, 150.0],
               ("ddtree", 32, 1): [999.0]}
    with transaction(db):
        db.execute("INSERT INTO runs (id, name, engine_kind, state, created_at) VALUES (1, 'r', 'builtin', "
                   "'succeeded', 1.0)")
        for (algorithm, budget, c), values in repeats.items():
            for n, tok_s in enumerate(values):
                state = "failed" if budget == 32 else "done"
                db.execute("INSERT INTO points (run_id, engine_kind, algorithm, budget, tp, gpus, concurrency, "
                           "dataset, temperature, repeat, state, output_tok_s) "
                           "VALUES (1, 'builtin', ?, ?, 1, '[]', ?, 'builtin:code', 0.0, ?, ?, ?)",
                           [algorithm, budget, c, n, state, tok_s])
    best = runs_page(db)[0][0]["best"]
    medians = [row["output_tok_s"] for row in cell_rows(list_points(db, 1)) if row["output_tok_s"] is not None]
    db.close()
    assert best == pytest.approx(155.0) == pytest.approx(max(medians))


def test_summary_columns_orders_and_the_count_beyond_the_page(db):
    rows, total = runs_page(db)
    first = {row["id"]: row for row in rows}
    assert (first[1]["points_done"], first[1]["best"]) == (2, 30.0)
    assert (first[2]["points_done"], first[2]["best"]) == (1, 20.0)  # the failed point counts for neither
    assert first[5]["best"] is None and total == 5
    assert ids(runs_page(db, order="oldest")) == [1, 2, 3, 4, 5]
    assert ids(runs_page(db, order="best tok/s")) == [1, 2, 5, 4, 3]
    assert ids(runs_page(db, order="name"))[:2] == [5, 3]  # no name sorts first, then "100% budget"
    assert set(RUN_ORDERS) == {"newest", "oldest", "name", "model", "best tok/s"}
    page, total = runs_page(db, limit=2)
    assert ids((page, total)) == [5, 4] and total == 5
    page, total = runs_page(db, "qwen3", limit=1)
    assert len(page) == 1 and total == 2


@pytest.mark.slow
async def test_the_pane_opens_on_the_pollers_page_and_queries_for_a_filter(db, tmp_path):
    app = make_app(tmp_path / "ddtree.db", poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(110, 30)) as pilot:
        await until(pilot, lambda: app.runs_page is not None, what="the poller's page")
        assert ids(app.runs_page) == [5, 4, 3, 2, 1]
        await pilot.press("6")
        # drawn from the poller's copy while the pane is built: no query of its own
        assert [r[0] for r in table_rows(app, "runs")] == ["5", "4", "3", "2", "1"]
        field = app.query_one("#history-filter")
        for text in ("q", "qw", "qwe", "qwen3_"):  # typed fast: only the last answer may stay
            field.value = text
        await until(pilot, lambda: [r[0] for r in table_rows(app, "runs")] == ["2"], what="the filtered run")
        await pilot.pause(0.3)
        assert [r[0] for r in table_rows(app, "runs")] == ["2"]
        assert "History: 1 run," in str(app.query_one("#history-title").render())
        await pilot.press("q")
