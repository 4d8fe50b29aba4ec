"""Overview: jobs with state and progress, a GPU strip (sparklines), disk headroom."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from ddtree.console import fmt
from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.widgets.tables import bar, fmt_bytes, sparkline, sync_table

if TYPE_CHECKING:  # the store imports sqlite-utils, which the first frame does without
    from ddtree.store.records import Job

JOB_COLUMNS = ("ID", "KIND", "NAME", "STATE", "PROGRESS", "TOOK", "INFO")
STATE_STYLE = {"running": "green", "starting": "yellow", "queued": "yellow", "failed": "red", "lost": "red",
               "cancelled": "dim", "succeeded": "dim green"}
#: GPU samples kept for the sparklines (one a second).
HISTORY = 40


def job_cells(job: Job, now: float) -> tuple:
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


def fmt_pct(value: float | None) -> str:
    return "  -" if value is None else f"{value:3.0f}%"


def disk_lines(host) -> Text:
    if host is None:
        return Text("disks: reading…", style="dim")
    out = Text()
    for disk in host.disks:
        used = disk.used / disk.total if disk.total else None
        role = {"hf_cache": "models (HF cache)", "data": "data (store, logs)"}.get(disk.role, disk.role)
        out.append(f"{role:<18} ", style="bold")
        out.append_text(bar(used, 16))
        out.append(f" used, {fmt_bytes(disk.free)} free of {fmt_bytes(disk.total)}  {disk.mount or disk.path}\n")
    out.rstrip()
    return out


class OverviewPane(Vertical):
    """What is running and how the machine is doing."""

    ALLOW_MAXIMIZE = True

    def compose(self) -> ComposeResult:
        yield Static("Jobs", classes="pane-title")
        yield RowTable(*JOB_COLUMNS, id="jobs")
        yield Static("GPUs", classes="pane-title")
        yield Static("No GPU: no sample yet", id="gpu-strip")
        yield Static("Disks", classes="pane-title")
        yield Static("disks: reading…", id="disks")

    def on_mount(self) -> None:
        self.watch(self.app, "snapshot", self.show_jobs)
        self.watch(self.app, "gpu_tick", self.show_gpus)
        self.watch(self.app, "host", self.show_disks)

    def show_jobs(self, snapshot) -> None:
        if snapshot is None:
            return
        now = self.app.clock()
        rows = []
        for job in snapshot.jobs:
            cells = job_cells(job, now)
            rows.append((str(job.id), cells[:3] + (Text(cells[3], style=STATE_STYLE.get(job.state, "")),) + cells[4:]))
        sync_table(self.query_one("#jobs", RowTable), rows)

    def show_gpus(self, _tick: int) -> None:
        app = self.app
        view = app.gpu_view
        names = {g.index: g.name for g in view.gpus} if view is not None else {}
        reason = app.gpu_reason()
        self.query_one("#gpu-strip", Static).update(gpu_strip(app.gpu_history, names, reason))

    def show_disks(self, host) -> None:
        self.query_one("#disks", Static).update(disk_lines(host))
