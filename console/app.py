"""The minimal Textual console: jobs and runs from the store, polled at a modest rate.

The store is read in a thread worker (SQLite calls block); the worker posts a `Snapshot`
message and the tables update from it on the UI thread. Nothing here writes to a job except
the start-up reconcile, so closing or killing the console never affects running jobs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Static
from textual.worker import Worker, WorkerState

from ddtree.console import fmt
from ddtree.jobs import supervisor
from ddtree.store.db import open_db, resolve_db_path
from ddtree.store.queries import list_jobs, list_runs
from ddtree.store.records import Job, Run

#: Seconds between store polls: modest, so a slow SSH link and a busy disk are not troubled.
POLL_S = 1.0

#: Rows shown per table (newest first).
MAX_ROWS = 200

JOB_COLUMNS = ("ID", "KIND", "NAME", "STATE", "PROGRESS", "TOOK", "INFO")
RUN_COLUMNS = ("ID", "NAME", "ENGINE", "MODEL", "STATE", "POINTS", "CREATED")


class Snapshot(Message):
    """What one poll of the store found."""

    def __init__(self, jobs: list[Job], runs: list[Run], at: float) -> None:
        super().__init__()
        self.jobs = jobs
        self.runs = runs
        self.at = at


def job_cells(job: Job, now: float) -> tuple[str, ...]:
    end = job.ended_at if job.ended_at is not None else now
    took = None if job.started_at is None else end - job.started_at
    info = job.error if job.state in ("failed", "lost", "cancelled") else job.progress_message
    return (
        str(job.id),
        job.kind,
        job.name or "-",
        job.state,
        fmt.progress(job.progress_done, job.progress_total),
        fmt.duration(took),
        fmt.one_line(info, 50),
    )


def run_cells(run: Run) -> tuple[str, ...]:
    points = f"{run.points_done}/{run.points_total}" if run.points_total else str(run.points_done)
    return (
        str(run.id),
        run.name or "-",
        run.engine_kind or "-",
        fmt.one_line(run.model, 32) or "-",
        run.state or "-",
        points,
        fmt.stamp(run.created_at),
    )


class ConsoleApp(App[int]):
    """ddtree-console: jobs and runs at a glance."""

    CSS_PATH = "app.tcss"
    TITLE = "ddtree-console"

    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("r", "refresh", "Refresh", id="refresh"),
        Binding("1", "focus_jobs", "Jobs", id="focus_jobs"),
        Binding("2", "focus_runs", "Runs", id="focus_runs"),
    ]

    def __init__(self, db_path: str | os.PathLike | None = None, *, poll_s: float = POLL_S) -> None:
        super().__init__()
        self.db_path: Path = resolve_db_path(db_path)
        """The store this console reads."""
        self.poll_s = poll_s
        """Seconds between polls of the store."""
        self.sub_title = str(self.db_path)
        self.last_snapshot: Snapshot | None = None
        """The latest poll result (tests and later screens read it)."""

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="main"):
            yield Static("Jobs", classes="pane-title")
            yield DataTable(id="jobs", cursor_type="row", zebra_stripes=True)
            yield Static("Runs", classes="pane-title")
            yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Static("loading…", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#jobs", DataTable).add_columns(*JOB_COLUMNS)
        self.query_one("#runs", DataTable).add_columns(*RUN_COLUMNS)
        self.poll_store(reconcile=True)
        self.set_interval(self.poll_s, self.poll_store)

    @work(thread=True, exclusive=True, exit_on_error=False, group="poll")
    def poll_store(self, reconcile: bool = False) -> None:
        if reconcile:
            supervisor.reconcile(self.db_path)
        with open_db(self.db_path) as db:
            jobs = list_jobs(db, limit=MAX_ROWS)
            runs = list_runs(db, limit=MAX_ROWS)
        self.post_message(Snapshot(jobs, runs, time.time()))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "poll" and event.state == WorkerState.ERROR:
            text = f"[b red]store error:[/] {fmt.one_line(str(event.worker.error), 120)}"
            for status in self.query("#status").results(Static):  # absent while shutting down
                status.update(text)

    def on_snapshot(self, message: Snapshot) -> None:
        self.last_snapshot = message
        _sync(self.query_one("#jobs", DataTable), [(str(j.id), job_cells(j, message.at)) for j in message.jobs])
        _sync(self.query_one("#runs", DataTable), [(str(r.id), run_cells(r)) for r in message.runs])
        active = sum(1 for j in message.jobs if not j.terminal)
        self.query_one("#status", Static).update(
            f"{len(message.jobs)} jobs ({active} active), {len(message.runs)} runs; "
            f"updated {time.strftime('%H:%M:%S', time.localtime(message.at))}"
        )

    def action_refresh(self) -> None:
        self.poll_store()

    def action_focus_jobs(self) -> None:
        self.query_one("#jobs", DataTable).focus()

    def action_focus_runs(self) -> None:
        self.query_one("#runs", DataTable).focus()


def _sync(table: DataTable, rows: list[tuple[str, tuple[str, ...]]]) -> None:
    """Make `table` show `rows` (key, cells), keeping the cursor on the same key."""
    keys = [key for key, _ in rows]
    current = [row_key.value for row_key in table.rows]
    if keys == current:
        for key, cells in rows:
            for column_key, value in zip(table.columns, cells):
                if table.get_cell(key, column_key) != value:
                    table.update_cell(key, column_key, value)
        return
    selected = None
    if table.row_count and table.cursor_row is not None and 0 <= table.cursor_row < table.row_count:
        selected = current[table.cursor_row]
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    if selected in keys:
        table.move_cursor(row=keys.index(selected))


def make_app(db_path: str | os.PathLike | None = None, *, poll_s: float = POLL_S) -> ConsoleApp:
    return ConsoleApp(db_path, poll_s=poll_s)


def run_app(db_path: str | os.PathLike | None = None) -> int:
    """Open the store (so a bad path fails before the screen changes), then run the console."""
    open_db(db_path).close()
    app = make_app(db_path)
    app.run()
    return app.return_code or 0
