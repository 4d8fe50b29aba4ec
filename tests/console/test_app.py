import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pytest

from ddtree.console.app import make_app
from ddtree.console.screens.overview import JOB_COLUMNS
from ddtree.jobs import submit
from ddtree.jobs.model import create_job, set_state
from ddtree.store import open_db
from ddtree.store.queries import insert_row, update_row

from ..support.pilot import until
from .cockpit_support import table_rows as rows

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "ddtree.db")


def status(app):
    return str(app.query_one("#status").render())


async def test_shows_jobs_and_runs_and_follows_changes(db_path):
    with open_db(db_path) as db:
        done = create_job(db, "sleep", {"seconds": 1}, name="nap")
        set_state(db, done, "starting")
        set_state(db, done, "running")
        set_state(db, done, "failed", "it broke")
        run_id = insert_row(db, "runs", {"name": "k26-sweep", "engine_kind": "sglang", "model": "moonshotai/Kimi-K2.6",
                                         "state": "running", "points_total": 4, "created_at": time.time()})
        insert_row(db, "points", {"run_id": run_id, "state": "done"})
    app = make_app(db_path, poll_s=0.1)
    async with app.run_test(size=(140, 40)) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None)
        (job_row,) = rows(app, "jobs")
        assert dict(zip(JOB_COLUMNS, job_row)) == {"ID": str(done), "KIND": "sleep", "NAME": "nap", "STATE": "failed",
                                                   "PROGRESS": "-", "TOOK": "0s", "ETA": "-", "INFO": "it broke"}
        await pilot.press("6")  # panes are built on their first visit
        await until(pilot, lambda: rows(app, "runs"))
        (run_row,) = rows(app, "runs")
        assert run_row[:6] == [str(run_id), "k26-sweep", "sglang", "moonshotai/Kimi-K2.6", "running", "1/4"]
        assert "1 job (0 active), 1 run;" in status(app)
        # a new job and progress on the run show up on the next polls
        with open_db(db_path) as db:
            new = create_job(db, "shell", {"argv": ["true"]})
            update_row(db, "jobs", new, {"progress_done": 1, "progress_total": 4, "progress_message": "warming up"})
            insert_row(db, "points", {"run_id": run_id, "state": "done"})
        await pilot.press("1")
        await until(pilot, lambda: len(rows(app, "jobs")) == 2)
        assert rows(app, "jobs")[0][:5] == [str(new), "shell", "-", "queued", "25%"]
        assert rows(app, "jobs")[0][JOB_COLUMNS.index("INFO")] == "warming up"
        await until(pilot, lambda: rows(app, "runs")[0][5] == "2/4")
        await pilot.press("q")
    assert app.return_code == 0


async def test_start_up_reconciles_dead_runners(db_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open_db(db_path) as db:
        job_id = create_job(db, "sleep", {"seconds": 60})
        set_state(db, job_id, "starting")
        set_state(db, job_id, "running")
        update_row(db, "jobs", job_id, {"pid": dead.pid, "heartbeat_at": time.time() - 3600})
    app = make_app(db_path, poll_s=0.1)
    async with app.run_test() as pilot:
        await until(pilot, lambda: rows(app, "jobs") and rows(app, "jobs")[0][3] == "lost")
        assert "gone" in rows(app, "jobs")[0][JOB_COLUMNS.index("INFO")]
        await pilot.press("q")


async def test_store_error_is_shown_not_raised(tmp_path):
    (tmp_path / "afile").write_text("x")
    app = make_app(tmp_path / "afile" / "ddtree.db", poll_s=0.1)
    async with app.run_test() as pilot:
        await until(pilot, lambda: "store error" in status(app))
        assert "is not a folder" in status(app)
        await pilot.press("q")


OTHER_CONSOLE = textwrap.dedent(
    """
    import json, sys
    from ddtree.console.app import make_app
    app = make_app(sys.argv[1], poll_s=0.1)
    seen = set()
    def look():
        snap = app.last_snapshot
        if snap:
            seen.update(j.state for j in snap.jobs)
        if "succeeded" in seen:
            app.exit(0)
    app.call_later(lambda: app.set_interval(0.05, look))
    app.run(headless=True, size=(100, 30))
    print(json.dumps(sorted(seen)))
    """
)


@pytest.mark.slow
async def test_two_consoles_at_once_while_a_job_runs(db_path):
    open_db(db_path).close()
    other = subprocess.Popen([sys.executable, "-c", OTHER_CONSOLE, db_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    app = make_app(db_path, poll_s=0.1)
    async with app.run_test() as pilot:
        job_id = submit(db_path, "sleep", {"seconds": 1.0})
        await until(pilot, lambda: rows(app, "jobs") and rows(app, "jobs")[0][3] == "succeeded")
        assert rows(app, "jobs")[0][0] == str(job_id)
        await pilot.press("q")
    out, err = await asyncio.to_thread(other.communicate, timeout=60)
    assert other.returncode == 0, err
    assert "succeeded" in json.loads(out.strip().splitlines()[-1])


def test_entry_point_opens_and_quits_in_a_terminal(db_path):
    exe = os.path.join(os.path.dirname(sys.executable), "ddtree-console")
    main, child = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100", LINES="30")
    proc = subprocess.Popen([exe, "--db", db_path], stdin=child, stdout=child, stderr=child, env=env, start_new_session=True)
    os.close(child)
    screen = b""
    polls = 150  # reads of up to 0.2 s each: a bound for a loaded box, not a speed claim
    try:
        while b"Overview" not in screen or b"updated" not in screen:
            polls -= 1
            assert polls > 0, screen[-2000:]
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    screen += os.read(main, 65536)
                except OSError:
                    break
        os.write(main, b"q")
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    assert b"Traceback" not in screen
