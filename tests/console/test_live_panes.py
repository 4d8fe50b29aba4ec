"""Live, correct panes (issue 17): durations that tick on a clock the test sets, engines ordered
and filtered, the Overview's log/cancel/go-to keys, sweep ETAs, disk figures as df has them, the
quit note, plurals."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from .cockpit_support import NOW, fixed_sources, seed_store, table_rows, text_of, until
from .clock import Clock
from .row_logs import log_of

from ddtree.console.app import make_app
from ddtree.console.disks import disk_figures
from ddtree.console.eta import run_progress, sweep_progress
from ddtree.console.quitnote import quit_note
from ddtree.console.screens.engines import COLUMNS, engine_order
from ddtree.console.screens.modals import ConfirmScreen
from ddtree.console.words import plural
from ddtree.store import open_db
from ddtree.store.queries import insert_row, update_row

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def seeded(tmp_path):
    db_path = tmp_path / "ddtree.db"
    return db_path, seed_store(db_path)


def cell(app, table: str, key_col: int, key: str, col: int) -> str | None:
    """Column `col` of the row whose column `key_col` is `key` (None while there is none)."""
    return next((r[col] for r in table_rows(app, table) if r[key_col] == key), None)


def first_cell(app, table: str, col: int) -> str | None:
    rows = table_rows(app, table)
    return rows[0][col] if rows else None


async def ticks(pilot, clock: Clock, read, before: str, step: float, after: str, what: str) -> None:
    """`read()` shows `before` once its row is there, and `after` when only the clock moved `step` s
    (the store does not change)."""
    await until(pilot, lambda: read() is not None, what=what)
    assert read() == before
    clock.t += step
    await until(pilot, lambda: read() == after, what=f"{what} {step:g} s later")


@pytest.mark.slow
async def test_uptime_and_running_times_tick_between_polls(seeded):
    db_path, ids = seeded
    clock = Clock()
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=clock)
    async with app.run_test(size=(120, 40)) as pilot:
        job = str(ids["sweep_job"])
        await ticks(pilot, clock, lambda: cell(app, "jobs", 0, job, 5), "10m00s", 7, "10m07s", "the running time")
        await pilot.press("4")
        up = COLUMNS.index("UPTIME")
        await ticks(pilot, clock, lambda: first_cell(app, "engine-table", up), "14m47s", 13, "15m00s", "the uptime")


def test_engines_running_first_then_starting_newest_first_and_stopped_only_when_asked():
    rows = [{"id": 1, "state": "stopped", "created_at": 10}, {"id": 2, "state": "running", "created_at": 20},
            {"id": 3, "state": "failed", "created_at": 30}, {"id": 4, "state": "running", "created_at": 40},
            {"id": 5, "state": "starting", "created_at": 50}]
    assert [r["id"] for r in engine_order(rows)] == [4, 2, 5]
    assert [r["id"] for r in engine_order(rows, show_stopped=True)] == [4, 2, 5, 3, 1]
    # the one under the cursor stays while it stops
    assert [r["id"] for r in engine_order(rows, keep="1")] == [4, 2, 5, 1]


async def test_engines_pane_hides_stopped_engines_behind_a(seeded):
    db_path, ids = seeded
    with open_db(db_path) as db:
        for n, state in enumerate(("stopped", "failed")):
            insert_row(db, "engines", {"job_id": None, "kind": "sglang", "model": "Qwen/Qwen3-8B", "algorithm": "dflash",
                                       "gpus": "[0]", "state": state, "created_at": NOW - 5000 + n})
        insert_row(db, "engines", {"job_id": None, "kind": "builtin", "model": "demo", "algorithm": "ddtree",
                                   "gpus": "[]", "state": "running", "port": 40200, "base_url": "http://127.0.0.1:40200",
                                   "created_at": NOW - 60, "ready_at": NOW - 50})
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        state, port = COLUMNS.index("STATE"), COLUMNS.index("PORT")
        await until(pilot, lambda: len(table_rows(app, "engine-table")) == 2, what="the running engines")
        assert [r[port] for r in table_rows(app, "engine-table")] == ["40200", "40123"]  # newest first
        assert "2 stopped hidden" in text_of(app, "engines-title")
        await pilot.press("a")
        assert [r[state] for r in table_rows(app, "engine-table")] == ["running", "running", "failed", "stopped"]
        assert "hides them" in text_of(app, "engines-title")
        await pilot.press("a")
        assert len(table_rows(app, "engine-table")) == 2


async def open_job_log(app, pilot, job_id):
    """The Overview's jobs table, its row keys, and the log view once `l` opened job_id's log."""
    await until(pilot, lambda: len(table_rows(app, "jobs")) == 3, what="the jobs")
    table = app.query_one("#jobs")
    keys = [table.row_key_at(i) for i in range(table.row_count)]
    table.move_cursor(row=keys.index(str(job_id)))
    await pilot.press("l")
    return table, keys, app.query_one("#job-log")


@pytest.mark.slow
async def test_overview_shows_a_jobs_log_cancels_it_and_goes_to_its_pane(seeded, tmp_path):
    db_path, ids = seeded
    log_of(db_path, "jobs", ids["sweep_job"], tmp_path / "sweep.log", "box check: idle\npoint 9 done\n")
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(80, 24)) as pilot:
        table, keys, view = await open_job_log(app, pilot, ids["sweep_job"])
        await until(pilot, lambda: view.raw_lines[:2] == ["box check: idle", "point 9 done"], what="the job's log")
        assert not app.query_one("#gpu-strip").display  # the log takes the GPUs' and disks' room
        await pilot.press("l")
        assert app.query_one("#gpu-strip").display and not view.display
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        assert f"job {ids['sweep_job']}" in str(app.screen.query_one("#question").render())
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("g")
        await until(pilot, lambda: app.current_pane == "sweeps", what="the Sweeps pane")
        assert app.shown_run().id == ids["live_run"]
        await pilot.press("1")
        table.move_cursor(row=keys.index(str(ids["engine_job"])))
        await pilot.press("enter")
        await until(pilot, lambda: app.current_pane == "engines", what="the Engines pane")
        assert app.query_one("#engines").selected()["job_id"] == ids["engine_job"]


async def test_overview_log_wraps_long_lines_at_the_panes_width(seeded, tmp_path):
    """A log line longer than the pane goes on under itself, at 80 columns and after a resize,
    instead of being cut at the edge (the Overview has no key to scroll sideways)."""
    db_path, ids = seeded
    words = " ".join(f"word{n:03d}" for n in range(40))  # 319 characters
    log_of(db_path, "jobs", ids["sweep_job"], tmp_path / "sweep.log", f"short line\n{words} END\n")
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)

    def shown(view) -> list[str]:
        return [strip.text.rstrip() for strip in view.lines]

    async with app.run_test(size=(80, 24)) as pilot:
        table, keys, view = await open_job_log(app, pilot, ids["sweep_job"])
        await until(pilot, lambda: any("END" in line for line in shown(view)), what="the end of the long line")
        width = view.scrollable_content_region.width
        assert width < 80 and all(len(line) <= width for line in shown(view))
        assert shown(view)[0] == "short line" and len(shown(view)) >= 1 + 319 // width
        assert " ".join(shown(view)[1:]) == f"{words} END"  # broken between words, nothing lost
        await pilot.resize_terminal(120, 30)
        await until(pilot, lambda: view.scrollable_content_region.width > width
                    and max(len(line) for line in shown(view)) > width, what="the lines laid out again")
        assert all(len(line) <= view.scrollable_content_region.width for line in shown(view))
        assert " ".join(shown(view)[1:]) == f"{words} END"


@dataclass
class P:
    state: str
    started_at: float | None = None
    ended_at: float | None = None
    algorithm: str = "ddtree"
    budget: int | None = 16
    concurrency: int = 1
    tp: int = 1
    idx: int = 0


def test_sweep_eta_is_the_median_point_time_times_what_is_left():
    points = [P("done", 0, 40, idx=0), P("done", 40, 60, idx=1), P("done", 60, 82, idx=2),  # 40, 20, 22 s
              P("running", 82, idx=3), P("pending", idx=4), P("pending", idx=5)]
    p = sweep_progress(points, now=92.0)
    assert (p.done, p.total, p.per_point_s) == (3, 6, 22.0)
    assert p.eta_s == 22.0 * 2 + (22.0 - 10.0)  # two to go, and the rest of the one running
    assert p.current == "point 4: ddtree budget 16 c=1"
    assert p.text == "3/6 points, ETA 56s"
    assert sweep_progress([P("pending"), P("pending")], now=0).eta_s is None  # nothing measured yet
    overrun = sweep_progress([P("done", 0, 10), P("running", 10)], now=100)
    assert overrun.eta_s == 0.0  # the running point took longer than usual: no negative time


def test_run_level_eta_without_the_points():
    @dataclass
    class Run:
        points_total: int = 10
        points_done: int = 4
        points_failed: int = 1
        started_at: float = 0.0
        created_at: float = 0.0
        ended_at: float | None = None
        state: str = "running"

    p = run_progress(Run(), now=100.0)
    assert (p.done, p.eta_s) == (5, 100.0)
    assert run_progress(Run(ended_at=100.0, state="failed"), now=200.0).eta_s == 0.0


def test_disk_figures_agree_with_statvfs_and_df(tmp_path):
    st = os.statvfs(tmp_path)
    usage = shutil.disk_usage(tmp_path)
    f = disk_figures(usage.total, usage.used, usage.free)
    assert f.free == st.f_bavail * st.f_frsize  # what a user can write
    assert f.reserve == (st.f_bfree - st.f_bavail) * st.f_frsize
    df = shutil.which("df")
    if df is None:
        pytest.skip("no df here")
    out = subprocess.run([df, "-P", "-B1", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    fields = out.splitlines()[-1].split()
    used, avail, pct = int(fields[2]), int(fields[3]), int(fields[4].rstrip("%"))
    # the filesystem may move between the two reads (other processes write): a few MB of slack
    assert abs(f.used - used) < 64 << 20 and abs(f.free - avail) < 64 << 20
    assert abs(f.used_pct - pct) <= 1


def test_df_rounds_used_percent_up_and_counts_it_against_what_users_can_fill():
    # ext4's 5% root reserve: 50 of 100 blocks used, 45 free for users, 5 reserved
    f = disk_figures(total=100, used=50, free=45)
    assert (f.used_pct, f.free, f.reserve) == (53, 45, 5)  # 50/95 = 52.6 -> 53, as df says
    assert disk_figures(0, 0, 0).used_pct is None


async def test_overview_disks_show_df_percent_and_reserve(seeded):
    db_path, _ = seeded
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "data (store, logs)" in text_of(app, "disks"), what="the disks")
        disks = text_of(app, "disks")
        # models: 3.84 TB, 2.1 TB used, 1.74 TB free -> 55% used; data: 120 of 480 GB used, 360 GB free -> 25%
        assert "55% used, 1.7 TB free of 3.8 TB" in disks and "25% used, 360.0 GB free of 480.0 GB" in disks


def test_quit_note_names_the_running_jobs_and_how_to_get_back():
    @dataclass
    class J:
        id: int
        kind: str
        state: str
        name: str | None = None

        @property
        def terminal(self) -> bool:
            return self.state in ("succeeded", "failed", "cancelled", "lost")

    assert quit_note([J(1, "sweep", "succeeded")]) is None
    note = quit_note([J(4, "sweep", "running", "k26"), J(5, "engine", "running", "demo-engine"),
                      J(1, "download", "failed")], db_path="/x/ddtree.db")
    assert note.splitlines()[0] == "2 jobs still running; closing the console stops none of them:"
    assert "job 4" in note and "job 5" in note and "job 1 " not in note
    assert "ddtree-console --db /x/ddtree.db" in note and "jobs logs --follow JOB_ID" in note
    assert quit_note([J(4, "sweep", "running")]).startswith("1 job still running")


def test_plurals():
    assert plural(1, "run") == "1 run" and plural(0, "run") == "0 runs" and plural(2, "run") == "2 runs"
    assert plural(2, "point in progress", "points in progress") == "2 points in progress"


async def test_the_palette_runs_a_panes_own_keys_too(seeded):
    from ddtree.console.palette import ACTIONS, run

    db_path, _ = seeded
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: table_rows(app, "jobs"), what="the jobs")
        stopped = next(a for a in ACTIONS if a.action == "toggle_stopped")
        await run(app, stopped)
        await pilot.pause(0.05)
        assert app.current_pane == "engines" and app.query_one("#engines").show_stopped
        log = next(a for a in ACTIONS if a.action == "toggle_log")
        await run(app, log)
        await pilot.pause(0.05)
        assert app.current_pane == "overview" and app.query_one("#job-log").display


def test_a_downloads_eta_counts_down_from_its_last_update():
    from ddtree.console.eta import download_eta

    row = {"eta_s": 120.0, "updated_at": 1000.0}
    assert download_eta(row, 1000.0) == 120.0 and download_eta(row, 1030.0) == 90.0
    assert download_eta(row, 2000.0) == 0.0  # late, not negative
    assert download_eta({"eta_s": 50.0}, 5.0) == 50.0 and download_eta({}, 5.0) is None


async def test_the_downloads_pane_eta_ticks(seeded):
    from ddtree.console.screens.downloads import COLUMNS as DL

    db_path, ids = seeded
    with open_db(db_path) as db:
        update_row(db, "downloads", 1, {"updated_at": NOW})
    clock = Clock()
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=clock)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("3")
        eta = DL.index("ETA")
        await ticks(pilot, clock, lambda: first_cell(app, "download-table", eta), "2m01s", 61, "1m00s", "the ETA")
        # the Overview redraws on a timer of its own, not with the Downloads pane's
        await until(pilot, lambda: cell(app, "jobs", 0, str(ids["download_job"]), 6) == "1m00s",
                    what="the Overview's ETA")
        assert cell(app, "jobs", 0, str(ids["download_job"]), 6) == "1m00s"
