"""What the app says as it closes and in its status line, and its public way to show a run
(issue 17): the quit note after the screen is gone, plurals, `ConsoleApp.show_run`."""

from __future__ import annotations

import pytest

from .cockpit_support import fixed_sources, seed_store, text_of, until

from ddtree.console.app import closing_note, make_app
from ddtree.jobs.model import create_job
from ddtree.store import open_db

pytestmark = pytest.mark.timeout(60)


async def test_closing_note_names_the_jobs_of_the_last_poll_and_the_store_the_user_named(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources())
    assert closing_note(app, db_path) is None  # no poll yet: nothing known to be running
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        await pilot.press("q")
    note = closing_note(app, db_path)
    assert note.startswith("3 jobs still running")
    assert f"job {ids['sweep_job']}" in note and f"--db {db_path}" in note
    # the default store: the commands are the plain ones
    assert "--db" not in closing_note(app, None)


async def test_status_line_counts_in_words(tmp_path):
    db_path = tmp_path / "ddtree.db"
    with open_db(db_path) as db:
        create_job(db, "download", {"repo_id": "Qwen/Qwen3-8B"}, name="Qwen/Qwen3-8B")
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources())
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "updated" in text_of(app, "status"), what="the status line")
        status = text_of(app, "status")
        assert status.startswith("1 job (1 active), 0 runs;"), status


async def test_show_run_follows_the_picked_run(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources())
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        app.show_run(ids["old_run"])
        assert app.sweep_run_id == ids["old_run"] and app.shown_run().id == ids["old_run"]
        await until(pilot, lambda: app.points is not None and app.points[0] == ids["old_run"] and app.points[1],
                    what="the old run's points")
        app.show_run(ids["live_run"])
        await until(pilot, lambda: app.points[0] == ids["live_run"] and app.points[1], what="the live run's points")
