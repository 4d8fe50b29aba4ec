"""The Textual cockpit: six panes over the store, every launch a job, every stop confirmed.

A `Poller` (console/poll.py) reads the store and the hardware on a thread worker and posts only
what changed; the app keeps the latest value of each part in a `var` that the panes watch, so a
pane redraws only when its data changed, at most twice a second. Everything the console starts is
a detached job (jobs.submit), so closing the console or losing SSH leaves it running, and a new
console shows it again. Blocking calls (submit, cancel, queries of the History pane) run on thread
workers; their failures become a notification, never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rich.text import Text
from textual import work
from textual.actions import SkipAction
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.reactive import var
from textual.widget import Widget
from textual.widgets import ContentSwitcher, Input, Static, Tab, Tabs
from textual.worker import Worker, WorkerState

from ddtree.console import fmt, messages
from ddtree.console.palette import PANES, SHORT_TITLES, system_commands
from ddtree.console.poll import Sources
from ddtree.console.quitnote import quit_note
from ddtree.console.screens.overview import HISTORY, OverviewPane
from ddtree.console.widgets.keybar import KeyBar
from ddtree.console.words import plural

#: Seconds between polls of the store: at most two UI updates a second, fine over slow SSH.
POLL_S = 0.5
#: From this terminal width on, the tabs show the panes' full titles (they take 69 columns).
TABS_FULL_W = 70
NOTIFY_S = 5.0
"""The longest a toast stays: a few seconds, as Textual's own; errors that matter stay in the panes."""

#: Where each pane's class lives. Only the Overview is built at start; the others are imported
#: and composed on their first visit, so the first frame pays for one pane, not six.
PANE_CLASSES = {"overview": "overview:OverviewPane", "hardware": "hardware:HardwarePane",
                "downloads": "downloads:DownloadsPane", "engines": "engines:EnginesPane",
                "sweeps": "sweeps:SweepsPane", "history": "history:HistoryPane"}


def pane_class(pane: str) -> type[Widget]:
    module, name = PANE_CLASSES[pane].split(":")
    return getattr(importlib.import_module(f"ddtree.console.screens.{module}"), name)


class ConsoleApp(App[int]):
    """ddtree-console: downloads, hardware, engines, sweeps and their history."""

    CSS_PATH = "app.tcss"
    TITLE = "ddtree-console"

    BINDINGS = [
        *(Binding(key, f"show_pane('{pane}')", title, id=f"pane_{pane}", show=False) for pane, key, title, _ in PANES),
        Binding("m", "maximize_pane", "Max", id="maximize"),
        Binding("question_mark", "help", "Help", id="help"),
        Binding("t", "toggle_theme", "Theme", id="theme", show=False),
        Binding("r", "refresh", "Refresh", id="refresh", show=False),
        Binding("q", "quit", "Quit", id="quit"),
    ]

    snapshot = var(None, always_update=False)
    """Jobs and recent runs (a `Snapshot`), from the last poll that saw them change."""
    downloads: var[list] = var(list)
    """Rows of the downloads table, newest first."""
    engines = var(([], {}))
    """(rows of the engines table, {engine id: healthy?})."""
    points = var(None)
    """(run id, points) of the run the Sweeps pane shows."""
    runs_signature = var(None)
    """Changes whenever a run or point changed; the History pane reloads on it."""
    runs_page = None
    """The History pane's default page as of `runs_signature`: (rows, total)."""
    hardware = var(None)
    """(GpuView, HostInfo) refreshed every few seconds."""
    host = var(None)
    """The HostInfo part of `hardware` (the Overview's disks)."""
    gpu_tick = var(0)
    """Counts GPU samples; `gpu_history` holds them."""
    current_pane = var("overview")
    """The pane on screen."""

    def __init__(self, db_path: str | os.PathLike | None = None, *, poll_s: float = POLL_S,
                 sources: Sources | None = None, demo: bool = False, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        # No animations unless asked for (TEXTUAL_ANIMATIONS): the tab underline's slide redraws
        # sixty times a second while a pane is being built, and costs bandwidth over slow SSH.
        if "TEXTUAL_ANIMATIONS" not in os.environ:
            self.animation_level = "none"
        self._db_arg = db_path
        self._db_path: Path | None = None
        self.poll_s = poll_s
        self._toasts_until: dict[tuple[str, str], float] = {}  # (title, message): when its toast goes
        self.sources = sources or Sources()
        self.clock = clock
        """Now, for ages and uptimes (tests freeze it)."""
        self.demo = demo
        self.last_snapshot: messages.Snapshot | None = None
        self.gpu_history: dict[int, deque] = {}
        self.gpu_view = None
        self.sweep_run_id: int | None = None
        """The run the user picked in the Sweeps pane (None: follow the newest)."""
        self._watched: int | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.started_jobs: set[int] = set()
        """Jobs started from this console whose end it has not reported yet."""
        self._reader = None
        self._reader_lock = threading.Lock()
        self.check_store = False
        """Close the console if the store cannot be opened (the CLI sets it; tests show the error)."""
        self.store_error: Exception | None = None

    @property
    def db_path(self) -> Path:
        """The store this console reads (resolved on first use: the store package imports
        sqlite-utils, which is not needed for the first frame)."""
        if self._db_path is None:
            from ddtree.store.db import resolve_db_path

            self._db_path = resolve_db_path(self._db_arg)
        return self._db_path

    # -- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Tabs(*(Tab(f"{key} {title}", id=f"tab-{pane}") for pane, key, title, _ in PANES), id="pane-tabs")
        with ContentSwitcher(initial="overview", id="panes"):
            yield OverviewPane(id="overview", classes="pane")
        yield Static("loading…", id="status")
        yield KeyBar(id="footer")

    def on_resize(self, event) -> None:
        self.show_tab_titles(event.size.width)

    def show_tab_titles(self, width: int) -> None:
        """The panes' full titles where they fit, shorter ones (HW, DL) on a narrow terminal."""
        short = width < TABS_FULL_W
        for pane, key, title, _ in PANES:
            label = f"{key} {SHORT_TITLES.get(pane, title) if short else title}"
            tab = self.query_one(f"#tab-{pane}", Tab)
            if tab.label_text != label:
                tab.label = label

    def on_mount(self) -> None:
        # The store, the hardware and their imports come after the first frame is on screen.
        self.call_after_refresh(self._start)

    def _start(self) -> None:
        self.poll_loop()
        if self.demo:
            self.start_demo()

    def get_system_commands(self, screen):
        yield from system_commands(self)
        yield from super().get_system_commands(screen)

    # -- polling -------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False, group="poll")
    def poll_loop(self) -> None:
        from ddtree.console.poll import Poller
        from ddtree.store.db import open_db
        from ddtree.store.errors import StoreError

        if self.check_store:
            try:
                open_db(self.db_path).close()
            except StoreError as exc:
                self.store_error = exc
                self.call_from_thread(self.exit, exc.exit_code)
                return
        poller = Poller(self.db_path, self.sources, watched_run=lambda: self._watched)
        self.call_from_thread(setattr, self, "sub_title", str(self.db_path))
        poller.loop(self.post_message, self._stop, self.poll_s, self._wake)

    @work(thread=True, exit_on_error=False, group="warm-up")
    def warm_up(self) -> None:
        """Import the other panes' modules while the user reads the first one, so that a pane's
        first visit only builds it."""
        for pane in PANE_CLASSES:
            if self._stop.is_set():
                return
            importlib.import_module(f"ddtree.console.screens.{PANE_CLASSES[pane].split(':')[0]}")

    def _halt(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def action_quit(self) -> None:
        self._halt()
        self.exit(0)

    def on_unmount(self) -> None:
        self._halt()

    @contextmanager
    def reading(self):
        """The connection for queries made on thread workers, held by one of them at a time."""
        with self._reader_lock:
            if self._reader is None:
                from ddtree.store.db import open_db

                self._reader = open_db(self.db_path)
            yield self._reader

    def on_snapshot(self, message: messages.Snapshot) -> None:
        if self.last_snapshot is None:
            self.warm_up()
        self.last_snapshot = message
        self.snapshot = message
        self._follow_run()
        self._report_failures(message.jobs)
        active = sum(1 for j in message.jobs if not j.terminal)
        self._status(Text(f"{plural(len(message.jobs), 'job')} ({active} active), {plural(len(message.runs), 'run')}; "
                          f"updated {time.strftime('%H:%M:%S', time.localtime(message.at))}"))

    def _report_failures(self, jobs) -> None:
        """A job started here that failed says so at once: an engine that died at start otherwise
        only left the pane (and a "stopped hidden" count), its reason in a log."""
        for job in jobs:
            if job.id in self.started_jobs and job.terminal:
                self.started_jobs.discard(job.id)
                if job.state in ("failed", "lost"):
                    self.notify(fmt.one_line(job.error or "see its log (l)", 300),
                                title=f"{job.kind} job {job.id} {job.state}", severity="error")

    def _status(self, text: Text) -> None:
        # The poller's messages can still arrive while the app closes and its screen is gone.
        for status in self.query("#status").results(Static):
            status.update(text)

    def on_store_failed(self, message: messages.StoreFailed) -> None:
        self._status(Text.assemble(("store error: ", "bold red"), fmt.one_line(message.error, 120)))

    def on_downloads_changed(self, message: messages.DownloadsChanged) -> None:
        self.downloads = message.rows

    def on_engines_changed(self, message: messages.EnginesChanged) -> None:
        self.engines = (message.rows, message.health)

    def on_points_changed(self, message: messages.PointsChanged) -> None:
        if message.run_id == self._watched:
            self.points = (message.run_id, message.points)

    def on_runs_changed(self, message: messages.RunsChanged) -> None:
        self.runs_page = message.page
        self.runs_signature = message.signature

    def on_gpu_sampled(self, message: messages.GpuSampled) -> None:
        sample = message.sample
        if sample is None:
            return
        for g in sample.gpus:
            self.gpu_history.setdefault(g.index, deque(maxlen=HISTORY)).append(g)
        self.gpu_tick += 1

    def on_hardware_changed(self, message: messages.HardwareChanged) -> None:
        self.gpu_view = message.view
        self.hardware = (message.view, message.host)
        self.host = message.host
        self.gpu_tick += 1

    def gpu_reason(self) -> str | None:
        if self.gpu_view is not None and self.gpu_view.reason:
            return self.gpu_view.reason
        return None if self.gpu_history else "no GPU sample yet"

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state != WorkerState.ERROR:
            return
        error = event.worker.error
        if event.worker.group == "poll":
            self._status(Text.assemble(("store error: ", "bold red"), fmt.one_line(str(error), 120)))
        else:
            self.notify(fmt.one_line(str(error), 200), title=f"{event.worker.group} failed", severity="error")

    # -- the Sweeps pane's run -----------------------------------------------------------------
    def runs(self) -> list:
        return self.snapshot.runs if self.snapshot is not None else []

    def shown_run(self):
        runs = self.runs()
        if self.sweep_run_id is not None:
            found = next((r for r in runs if r.id == self.sweep_run_id), None)
            if found is not None:
                return found
        live = [r for r in runs if r.state in ("running", "queued")]
        return live[0] if live else (runs[0] if runs else None)

    def _follow_run(self) -> None:
        run = self.shown_run()
        run_id = run.id if run is not None else None
        if run_id != self._watched:
            self._watched = run_id
            self.points = (run_id, []) if run_id is not None else None
            self._wake.set()

    def show_run(self, run_id: int) -> None:
        """Show run `run_id` in the Sweeps pane from now on, and poll its points."""
        self.sweep_run_id = run_id
        self._follow_run()

    def _step_run(self, step: int) -> None:
        runs = self.runs()
        if not runs:
            return
        current = self.shown_run()
        index = next((i for i, r in enumerate(runs) if current is not None and r.id == current.id), 0)
        index = max(0, min(len(runs) - 1, index + step))
        self.show_run(runs[index].id)
        self.query_one("#sweeps").show_title(None)

    # -- pane actions --------------------------------------------------------------------------
    async def action_show_pane(self, pane: str) -> None:
        if pane not in PANE_CLASSES:
            return
        switcher = self.query_one("#panes", ContentSwitcher)
        if not switcher.query_children(f"#{pane}"):
            await switcher.add_content(pane_class(pane)(id=pane, classes="pane"), set_current=True)
        switcher.current = pane
        self.query_one("#pane-tabs", Tabs).active = f"tab-{pane}"
        self.current_pane = pane
        tables = switcher.get_child_by_id(pane).query("RowTable")
        if tables:
            tables.first().focus()

    async def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        pane = (event.tab.id or "").removeprefix("tab-")
        if pane and pane != self.current_pane:
            await self.action_show_pane(pane)

    def action_maximize_pane(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
        else:
            self.screen.maximize(self.query_one(f"#{self.current_pane}"), container=False)

    def action_help(self) -> None:
        from ddtree.console.screens.modals import HelpScreen

        self.push_screen(HelpScreen())

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = True) -> None:
        """A toast that goes within NOTIFY_S. One already on screen is not raised again: a failure
        repeated every poll would otherwise keep a toast up for good, over the pane's own error."""
        # Notifications reach app._notifications a turn of the queue later, so keep our own record.
        now, key = time.time(), (title, str(message))
        shown = self._toasts_until
        if shown.get(key, 0.0) > now:
            return
        timeout = NOTIFY_S if timeout is None else min(timeout, NOTIFY_S)
        shown[key] = now + timeout
        for old in [k for k, until in shown.items() if until <= now]:
            del shown[old]
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def action_refresh(self) -> None:
        self._wake.set()

    async def _pane(self, pane: str):
        """The pane, shown (and built, on its first visit)."""
        if self.current_pane != pane:
            await self.action_show_pane(pane)
        return self.query_one(f"#{pane}")

    # -- jobs from the console -----------------------------------------------------------------
    @work(thread=True, exit_on_error=False, group="submit")
    def submit_job(self, kind: str, spec: dict, name: str | None = None) -> None:
        from ddtree.jobs.supervisor import submit

        job_id = submit(self.db_path, kind, spec, name=name, detach=True)
        self.started_jobs.add(job_id)
        self.call_from_thread(self.notify, f"{kind} job {job_id} started", title="started")
        self._wake.set()

    @work(thread=True, exit_on_error=False, group="stop")
    def cancel_job(self, job_id: int) -> None:
        from ddtree.jobs.supervisor import cancel

        job = cancel(self.db_path, job_id, grace_s=10.0)
        self.call_from_thread(self.notify, f"job {job_id} {job.state}", title="stopped")
        self._wake.set()

    def job(self, job_id: int | None):
        """The job of that id in the newest snapshot, or None."""
        return next((j for j in (self.snapshot.jobs if self.snapshot else []) if j.id == job_id), None)

    def confirm_stop(self, job_id: int | None, what: str) -> None:
        if job_id is None:
            self.notify("nothing selected to stop", severity="warning")
            return
        job = self.job(job_id)
        if job is not None and job.terminal:
            self.notify(f"job {job_id} already {job.state}", severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.cancel_job(job_id)
            else:  # say so: a declined stop must not look like one that silently failed
                self.notify(f"{what} (job {job_id}) left running", title="not stopped")

        from ddtree.console.screens.modals import ConfirmScreen

        self.push_screen(ConfirmScreen(f"Stop {what} (job {job_id})?"), answered)

    async def action_new_download(self) -> None:
        await self._pane("downloads")
        from ddtree.console.screens.downloads import DownloadForm

        def done(spec: dict | None) -> None:
            if spec is not None:
                self.submit_job("download", spec, spec["repo_id"])

        self.push_screen(DownloadForm(), done)

    async def action_stop_download(self) -> None:
        row = (await self._pane("downloads")).selected()
        self.confirm_stop(row.get("job_id") if row else None, f"the download of {row['repo_id']}" if row else "")

    async def action_new_engine(self) -> None:
        await self._pane("engines")
        from ddtree.console.screens.engines import EngineForm

        def done(spec: dict | None) -> None:
            if spec is not None:
                self.submit_job("engine", spec, f"engine-{spec.get('algorithm', 'ddtree')}")

        self.push_screen(EngineForm(), done)

    async def action_stop_engine(self) -> None:
        row = (await self._pane("engines")).selected()
        if not row:
            self.confirm_stop(None, "")
            return
        what = f"the engine on port {row.get('port')}"
        job = self.job(row.get("job_id"))
        if job is not None and job.kind == "sweep":  # its engine is the sweep's job: stopping one stops both
            run = next((r for r in self.runs() if r.job_id == job.id), None)
            what += " and the sweep" + (f" run {run.id}" if run else "") + " that runs on it"
        self.confirm_stop(row.get("job_id"), what)

    async def action_engine_follow(self) -> None:
        (await self._pane("engines")).toggle_follow()

    async def action_engine_wrap(self) -> None:
        (await self._pane("engines")).toggle_wrap()

    async def action_engine_search(self) -> None:
        if isinstance(self.focused, Input):
            raise SkipAction()  # its binding is a priority one: a / typed into a box stays there
        (await self._pane("engines")).start_search()

    async def action_new_sweep(self) -> None:
        await self._pane("sweeps")
        from ddtree.console.screens.sweeps import SweepForm

        def done(spec: dict | None) -> None:
            if spec is not None:
                self.start_sweep(spec)

        self.push_screen(SweepForm(), done)

    @work(thread=True, exit_on_error=False, group="sweep")
    def start_sweep(self, spec: dict) -> None:
        """As `ddtree-console sweep --detach`, through the same `jobs.start.start_sweep`: the same
        checks (a refusal is the worker's error, shown as one line), then the run row (which the
        pane shows at once) and the job."""
        from ddtree.jobs.recipe import recipe_from_dict

        self._start_detached(recipe_from_dict(spec["recipe"]), spec.get("recipe_path"))

    def _start_detached(self, recipe, recipe_path: str | None = None) -> None:
        """Start `recipe` as a detached sweep and show its run (from a worker thread)."""
        from ddtree.jobs.start import start_sweep

        def follow(run_id: int) -> None:
            self.sweep_run_id = run_id

        started = start_sweep(self.db_path, recipe, recipe_path=recipe_path, on_run=follow)
        self.started_jobs.add(started.job_id)
        self.call_from_thread(self.notify, f"sweep run {started.run_id} started as job {started.job_id}",
                              title="started")
        self._wake.set()

    async def action_stop_sweep(self) -> None:
        await self._pane("sweeps")
        run = self.shown_run()
        if run is None or run.state not in ("running", "queued"):
            self.notify("the shown run is not running", severity="warning")
            return
        self.confirm_stop(run.job_id, f"sweep run {run.id} (resume it later: `ddtree-console sweep --resume {run.id}`)")

    async def action_settle_sweep(self) -> None:
        await self._pane("sweeps")
        run = self.shown_run()
        if run is None:
            self.notify("no run is shown", severity="warning")
            return
        job = self.job(run.job_id)
        if job is not None and not job.terminal:
            self.notify(f"run {run.id} is still running: its extra repeats can be planned once it has ended",
                        severity="warning")
            return
        self.settle_sweep(run.id)

    @work(thread=True, exit_on_error=False, group="sweep")
    def settle_sweep(self, run_id: int) -> None:
        """As `ddtree-console sweep --settle RUN_ID --detach`: the follow-up run that decides what the
        shown run's recommendation leaves open (a decided run is refused, as one line)."""
        from ddtree.jobs.settle import NothingToSettle, settle_recipe
        from ddtree.store import sweeps
        from ddtree.store.db import open_db

        with open_db(self.db_path) as db:
            try:
                recipe = settle_recipe(sweeps.get_run(db, run_id), sweeps.list_points(db, run_id))
            except NothingToSettle as exc:
                # an answer, not a failure: the worker's error toast was titled "sweep failed"
                self.call_from_thread(self.notify, fmt.one_line(str(exc), 200), title="nothing more to measure",
                                      severity="warning")
                return
        self._start_detached(recipe)

    async def action_sweep_prev(self) -> None:
        await self._pane("sweeps")
        self._step_run(+1)  # runs are newest first: "previous" is older

    async def action_sweep_next(self) -> None:
        await self._pane("sweeps")
        self._step_run(-1)

    async def action_history_filter(self) -> None:
        if isinstance(self.focused, Input):
            raise SkipAction()  # its binding is a priority one: a / typed into a box stays there
        (await self._pane("history")).focus_filter()

    async def action_history_mark(self) -> None:
        (await self._pane("history")).toggle_mark()

    async def action_history_sort(self) -> None:
        (await self._pane("history")).cycle_sort()

    async def action_history_compare(self) -> None:
        pane = await self._pane("history")
        ids = sorted(pane.marked)
        if len(ids) < 2:
            self.notify("select two or more runs first (space marks a run)", severity="warning")
            return
        self.open_compare(ids)

    @work(thread=True, exit_on_error=False, group="compare")
    def open_compare(self, ids: list[int]) -> None:
        from ddtree.console.screens.history import CompareScreen
        from ddtree.store import sweeps

        with self.reading() as db:
            runs = [sweeps.get_run(db, run_id) for run_id in ids]
            points = {run_id: sweeps.list_points(db, run_id) for run_id in ids}
        self.call_from_thread(self.push_screen, CompareScreen(runs, points))

    async def action_history_open(self) -> None:
        run_id = (await self._pane("history")).current()
        if run_id is None:
            self.notify("no run selected", severity="warning")
            return
        self.open_run(run_id)

    @work(thread=True, exit_on_error=False, group="run")
    def open_run(self, run_id: int) -> None:
        from ddtree.console.screens.rundetail import RunScreen
        from ddtree.store import sweeps
        from ddtree.store.errors import NotFound
        from ddtree.store.queries import get_job

        with self.reading() as db:
            run = sweeps.get_run(db, run_id)
            points = sweeps.list_points(db, run_id)
            log_path = None
            if run.job_id is not None:
                try:
                    log_path = get_job(db, run.job_id).log_path
                except NotFound:  # the job row was pruned; the run and its points stand alone
                    pass
        self.call_from_thread(self.push_screen, RunScreen(run, points, log_path))

    async def action_history_export(self) -> None:
        pane = await self._pane("history")
        run_id = pane.current()
        if run_id is None:
            self.notify("no run selected", severity="warning")
            return
        from ddtree.console.screens.history import ExportForm

        def done(choice: tuple[str, str] | None) -> None:
            if choice is not None:
                self.export(run_id, *choice)

        self.push_screen(ExportForm(run_id, self.db_path.parent / "exports"), done)

    @work(thread=True, exit_on_error=False, group="export")
    def export(self, run_id: int, fmt_name: str, path: str) -> None:
        from ddtree.console.export import export_run

        with self.reading() as db:
            written = export_run(db, run_id, fmt_name, path, make_parents=True)
        self.call_from_thread(self.notify, f"run {run_id} written to {written}", title="exported")

    # -- the demo ------------------------------------------------------------------------------
    @work(thread=True, exit_on_error=False, group="demo")
    def start_demo(self) -> None:
        """--demo: start the builtin engine on the demo pair unless one is already running."""
        from ddtree.jobs.supervisor import submit
        from ddtree.store.queries import list_jobs
        from ddtree.store.records import ACTIVE_STATES

        with self.reading() as db:
            running = [j for j in list_jobs(db, states=set(ACTIVE_STATES)) if j.kind == "engine"
                       and (j.spec or {}).get("kind", "builtin") == "builtin"]
        if running:
            return
        job_id = submit(self.db_path, "engine", {"kind": "builtin", "demo": True}, name="demo-engine", detach=True)
        self.call_from_thread(self.notify, f"demo engine starting (job {job_id})", title="demo")
        self._wake.set()


def make_app(db_path: str | os.PathLike | None = None, *, poll_s: float = POLL_S, sources: Sources | None = None,
             demo: bool = False, clock: Callable[[], float] = time.time) -> ConsoleApp:
    return ConsoleApp(db_path, poll_s=poll_s, sources=sources, demo=demo, clock=clock)


def run_app(db_path: str | os.PathLike | None = None, *, demo: bool = False) -> int:
    """Run the console; its exit code. The store is opened right after the first frame; if it
    cannot be (a damaged or foreign file, an unwritable folder), the console closes and the
    error is printed as the CLI prints errors: one line, with the StoreError's exit code."""
    app = make_app(db_path, demo=demo)
    app.check_store = True
    app.run()
    if app.store_error is not None:
        print(f"error: {app.store_error}", file=sys.stderr)
        return app.store_error.exit_code
    note = closing_note(app, db_path)
    if note is not None:
        print(note)
    return app.return_code or 0


def closing_note(app: ConsoleApp, db_path: str | os.PathLike | None) -> str | None:
    """What to print once the console is closed: the jobs of its last poll that still run and
    how to get back to them (quitnote.quit_note), or None. The store is named only when the user
    named one, so the commands it prints are the ones they would type."""
    jobs = app.last_snapshot.jobs if app.last_snapshot is not None else []
    return quit_note(jobs, str(db_path) if db_path is not None else None)
