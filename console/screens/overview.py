"""Overview: jobs with state, progress and ETA, a GPU strip (sparklines), disk headroom as `df`
reads it; the selected job's log (l), cancel it (x), or go to its pane (g or Enter)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from ddtree.console import fmt
from ddtree.console.palette import bindings
from ddtree.console.disks import disk_figures
from ddtree.console.eta import download_eta, run_progress, sweep_progress
from ddtree.console.widgets.logview import LogView
from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.widgets.tables import bar, fmt_bytes, sparkline, sync_table
from ddtree.console.words import plural

if TYPE_CHECKING:  # the store imports sqlite-utils, which the first frame does without
    from ddtree.store.records import Job

JOB_COLUMNS = ("ID", "KIND", "NAME", "STATE", "PROGRESS", "TOOK", "ETA", "INFO")
STATE_STYLE = {"running": "green", "starting": "yellow", "queued": "yellow", "failed": "red", "lost": "red",
               "cancelled": "dim", "succeeded": "dim green"}
#: GPU samples kept for the sparklines (one a second).
HISTORY = 40
#: The pane a job of each kind is watched in.
KIND_PANE = {"sweep": "sweeps", "engine": "engines", "download": "downloads"}


def job_cells(job: Job, now: float, *, progress: str | None = None, eta: float | None = None,
              info: str | None = None) -> tuple:
    """A row of the jobs table; `progress`, `eta` and `info` override what the job row says
    (a sweep's points, a download's rate)."""
    end = job.ended_at if job.ended_at is not None else now
    took = None if job.started_at is None else end - job.started_at
    if job.state == "cancelled" and job.error in (None, "cancel requested"):
        # Stores written before the runner said CANCELLED_REASON read as a request still pending.
        from ddtree.jobs.model import CANCELLED_REASON  # here: the jobs layer loads after the first frame

        info = CANCELLED_REASON
    elif job.state in ("failed", "lost", "cancelled"):
        info = job.error
    elif info is None:
        info = job.progress_message
    live = not job.terminal
    return (
        str(job.id),
        job.kind,
        job.name or "-",
        job.state,
        progress or fmt.progress(job.progress_done, job.progress_total),
        fmt.duration(took),
        fmt.duration(eta) if live else "-",
        fmt.one_line(info, 60),
    )


def gpu_strip(history: dict[int, deque], names: dict[int, str], reason: str | None, width: int = 24) -> Text:
    """One line per GPU: utilisation and memory sparklines with their latest values."""
    if not history:
        return Text(f"No GPU: {reason or 'no sample yet'}", style="yellow" if reason else "dim")
    out = Text()
    for index in sorted(history):
        samples = list(history[index])[-width:]
        utils = [s.util for s in samples]
        mems = [(s.mem_used / s.mem_total * 100) if s.mem_used is not None and s.mem_total else None for s in samples]
        last = samples[-1]
        name = (names.get(index) or "").replace("NVIDIA ", "")[:12]
        out.append(f"GPU{index:<2}", style="bold")
        out.append(f" {name:<12} util ")
        out.append(sparkline(utils, 0, 100).rjust(width), style="green")
        out.append(f" {fmt_pct(last.util)} mem ")
        out.append(sparkline(mems, 0, 100).rjust(width), style="dodger_blue2")
        out.append(f" {fmt_bytes(last.mem_used)}/{fmt_bytes(last.mem_total)}\n")
    out.rstrip()
    return out


def spark_width(columns: int) -> int:
    """Sparkline width so that one GPU keeps to one line: the labels and figures take 52 columns
    (two padding), the two sparklines share the rest."""
    return max(4, min(40, (columns - 54) // 2))


def fmt_pct(value: float | None) -> str:
    return "  -" if value is None else f"{value:3.0f}%"


def disk_lines(host) -> Text:
    """One line per disk, in `df`'s terms: used percent against what users can fill, free for a
    user (statvfs f_bavail), and the root reserve."""
    if host is None:
        return Text("disks: reading…", style="dim")
    out = Text()
    for disk in host.disks:
        f = disk_figures(disk.total, disk.used, disk.free)
        role = {"hf_cache": "models (HF cache)", "data": "data (store, logs)"}.get(disk.role, disk.role)
        out.append(f"{role:<18} ", style="bold")
        out.append_text(bar(None if f.used_pct is None else f.used_pct / 100, 12))
        out.append(f" used, {fmt_bytes(f.free)} free of {fmt_bytes(f.size)}")
        if f.reserve:
            out.append(f" ({fmt_bytes(f.reserve)} reserved)", style="dim")
        out.append(f"  {disk.mount or disk.path}\n")
    out.rstrip()
    return out


class OverviewPane(Vertical):
    """What is running and how the machine is doing."""

    ALLOW_MAXIMIZE = True

    BINDINGS = bindings("overview")  # from the palette's table, like the help and the palette

    #: Seconds between redraws of running times and ETAs (the store does not change every second).
    TICK_S = 1.0

    def compose(self) -> ComposeResult:
        with Horizontal(classes="pane-bar"):
            yield Static("Jobs", id="jobs-title", classes="pane-title grow")
        yield RowTable(*JOB_COLUMNS, id="jobs")
        yield Static("GPUs", classes="pane-title machine")
        yield Static("No GPU: no sample yet", id="gpu-strip", classes="machine")
        yield Static("Disks", classes="pane-title machine")
        yield Static("disks: reading…", id="disks", classes="machine")
        yield Static("Log", id="job-log-title", classes="pane-title job-log")
        # wrapped: this pane has no key to scroll sideways, so a long line would be cut at the edge
        yield LogView(id="job-log", classes="job-log", wrap=True)

    def on_mount(self) -> None:
        self.log_shown = False
        """Whether the selected job's log replaces the GPU strip and disks (key l)."""
        for w in self.query(".job-log"):
            w.display = False
        self.watch(self.app, "snapshot", self.show_jobs)
        self.watch(self.app, "gpu_tick", self.show_gpus)
        self.watch(self.app, "host", self.show_disks)
        self.watch(self.app, "downloads", lambda _rows: self.tick())
        self.watch(self.app, "points", lambda _points: self.tick())
        self.set_interval(self.TICK_S, self.tick)
        self.set_interval(0.5, self._tail)
        self.query_one("#jobs", RowTable).focus()  # so the footer shows this pane's keys from the start

    def tick(self) -> None:
        """Redraw the rows with the clock's now, so running times and ETAs move between polls."""
        if self.is_mounted:
            self.show_jobs(self.app.snapshot)

    def _extras(self, job, now: float, runs: dict, downloads: dict) -> dict:
        """A sweep's points done and ETA; a download's bytes, rate and ETA."""
        if job.kind == "sweep":
            run = runs.get(job.id)
            if run is None:
                return {}
            points = self.app.points
            if points is not None and points[0] == run.id and points[1]:
                p = sweep_progress(points[1], now, run.points_total)
            else:
                p = run_progress(run, now)
            if not p.total:
                return {}
            return {"progress": f"{p.done}/{p.total} pts", "eta": p.eta_s,
                    "info": p.current and f"{p.current} (run {run.id})"}
        if job.kind == "download":
            row = downloads.get(job.id)
            if row is None or row.get("state") not in ("running", "stalled"):
                return {}
            return {"eta": download_eta(row, now)}
        return {}

    def show_jobs(self, snapshot) -> None:
        if snapshot is None:
            return
        now = self.app.clock()
        runs = {r.job_id: r for r in snapshot.runs if r.job_id is not None}
        downloads = {r.get("job_id"): r for r in self.app.downloads}
        rows = []
        for job in snapshot.jobs:
            cells = job_cells(job, now, **self._extras(job, now, runs, downloads))
            rows.append((str(job.id), cells[:3] + (Text(cells[3], style=STATE_STYLE.get(job.state, "")),) + cells[4:]))
        sync_table(self.query_one("#jobs", RowTable), rows)
        active = sum(1 for j in snapshot.jobs if not j.terminal)
        title = Text.assemble(("Jobs", "bold"), f"  {plural(active, 'running job', 'running jobs')}",
                              (f" of {len(snapshot.jobs)}", "dim"))
        title.append("   enter/g", style="bold")
        title.append(" its pane  ", style="dim")
        title.append("l", style="bold")
        title.append(" log  ", style="dim")
        title.append("x", style="bold")
        title.append(" cancel", style="dim")
        self.query_one("#jobs-title", Static).update(title)
        if self.log_shown:
            self._open_log()

    def selected(self):
        key = self.query_one("#jobs", RowTable).cursor_key
        jobs = self.app.snapshot.jobs if self.app.snapshot is not None else []
        return next((j for j in jobs if str(j.id) == key), None)

    def action_toggle_log(self) -> None:
        self.log_shown = not self.log_shown
        for w in self.query(".job-log"):
            w.display = self.log_shown
        for w in self.query(".machine"):
            w.display = not self.log_shown
        if self.log_shown:
            # opened again once it has a size: a RichLog hidden until now holds back what it is given
            self.query_one("#job-log", LogView).path = None
            self.call_after_refresh(self._open_log)

    def _open_log(self) -> None:
        if not self.log_shown:
            return
        job = self.selected()
        log = self.query_one("#job-log", LogView)
        title = self.query_one("#job-log-title", Static)
        if job is None:
            title.update("Log")
            log.open(None)
            return
        title.update(Text.assemble((f"Log of job {job.id} ({job.kind})", "bold"),
                                   (f"  {job.log_path or 'no log file'}   l: back to GPUs and disks", "dim")))
        log.open(job.log_path)

    def _tail(self) -> None:
        if self.log_shown and self.display:
            self.query_one("#job-log", LogView).poll()

    def on_row_table_row_highlighted(self, _event) -> None:
        self._open_log()

    @on(RowTable.RowSelected, "#jobs")
    async def _selected(self, _event) -> None:
        await self.action_goto_job()

    def action_cancel_job(self) -> None:
        job = self.selected()
        if job is None:
            self.app.notify("no job selected", severity="warning")
            return
        self.app.confirm_stop(job.id, f"{job.kind} {fmt.one_line(job.name or '', 40)}".strip())

    async def action_goto_job(self) -> None:
        """The selected job's own pane, with its row (or its run) selected."""
        job = self.selected()
        if job is None:
            return
        pane = KIND_PANE.get(job.kind)
        if pane is None:
            self.app.notify(f"a {job.kind} job has no pane of its own; l shows its log", severity="warning")
            return
        app = self.app
        if job.kind == "sweep":
            run = next((r for r in app.runs() if r.job_id == job.id), None)
            if run is not None:
                app.show_run(run.id)
        await app.action_show_pane(pane)
        target = app.query_one(f"#{pane}")
        table_id = {"engines": "engine-table", "downloads": "download-table"}.get(pane)
        if table_id is not None:
            rows = app.engines[0] if pane == "engines" else app.downloads
            row = next((r for r in rows if r.get("job_id") == job.id), None)
            if row is not None:
                select_key(target.query_one(f"#{table_id}", RowTable), str(row["id"]))
        if pane == "sweeps" and hasattr(target, "show_title"):
            target.show_title(None)

    def show_gpus(self, _tick: int) -> None:
        app = self.app
        view = app.gpu_view
        names = {g.index: g.name for g in view.gpus} if view is not None else {}
        reason = app.gpu_reason()
        strip = self.query_one("#gpu-strip", Static)
        strip.update(gpu_strip(app.gpu_history, names, reason, width=spark_width(strip.size.width or self.app.size.width)))

    def on_resize(self, _event) -> None:
        self.show_gpus(self.app.gpu_tick)

    def show_disks(self, host) -> None:
        self.query_one("#disks", Static).update(disk_lines(host))


def select_key(table: RowTable, key: str) -> None:
    """Put `table`'s cursor on the row with `key`, if it shows one."""
    for i in range(table.row_count):
        if table.row_key_at(i) == key:
            table.move_cursor(row=i)
            return
