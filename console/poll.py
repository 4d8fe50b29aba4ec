"""The store poller: reads the store (and the hardware) on its own thread and posts only changes.

One `Poller.step()` is one round. It asks SQLite for `PRAGMA data_version` first, which changes
only when another connection committed, so an idle store costs one pragma per round; when it
changed, the poller reads jobs, recent runs, downloads, engines and the points of the run the
Sweeps pane watches, and emits a message for each part that differs from what it sent before.
GPU samples, engine health and host facts come at their own, slower rates. The app runs `loop`
in a thread worker at `interval_s` (0.5 s: at most two UI updates a second, fine over slow SSH).
The store modules are imported by the poller's thread, not with this module: sqlite-utils (and
the numpy it loads) would otherwise delay the console's first frame.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textual.message import Message

from ddtree.console.messages import (
    DownloadsChanged,
    EnginesChanged,
    GpuSampled,
    HardwareChanged,
    PointsChanged,
    RunsChanged,
    Snapshot,
    StoreFailed,
)
#: Rows of each table the console keeps (newest first).
MAX_ROWS = 200
#: Runs on the History pane's first page.
HISTORY_PAGE = 200


def _gpu_view() -> Any:
    from ddtree.engine.machine.hw import gpu_view

    return gpu_view()


def _host_info(folder: Path) -> Any:
    from ddtree.engine.machine.host import host_info

    return host_info(data_dir=folder)


class _SampleSource:
    """GPU and host utilisation through the engine's sampler (created on first use)."""

    def __init__(self) -> None:
        self.sampler = None

    def __call__(self) -> Any:
        if self.sampler is None:
            from ddtree.engine.machine.sampler import Sampler

            self.sampler = Sampler()
        return self.sampler.sample()


def _health(url: str) -> bool:
    from ddtree.engine.serving.http import health

    return health(url, timeout_s=0.5)


@dataclass
class Sources:
    """Where the poller gets what is not in the store; tests pass fixed ones."""

    gpu_view: Callable[[], Any] = _gpu_view
    host_info: Callable[[Path], Any] = _host_info
    gpu_sample: Callable[[], Any] = field(default_factory=_SampleSource)
    health: Callable[[str], bool] = _health
    now: Callable[[], float] = time.time
    #: Seconds between GPU samples, engine health checks and host/GPU-view refreshes.
    sample_s: float = 1.0
    health_s: float = 2.0
    hardware_s: float = 5.0


class Poller:
    """Reads what changed; `watched_run()` names the run whose points to follow (or None)."""

    def __init__(self, db_path: str | os.PathLike, sources: Sources | None = None, *,
                 watched_run: Callable[[], int | None] = lambda: None, reconcile: bool = True) -> None:
        self.db_path = Path(db_path)
        self.sources = sources or Sources()
        self.watched_run = watched_run
        self.reconcile = reconcile
        self.db = None
        self._data_version: int | None = None
        self._sent: dict[str, Any] = {}
        self._due: dict[str, float] = {}
        self._engines: list[dict] = []
        self._health: dict[int, bool | None] = {}

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    def _open(self) -> None:
        if self.db is None:
            from ddtree.store.db import open_db

            if self.reconcile:
                from ddtree.jobs.supervisor import reconcile

                reconcile(self.db_path)
                self.reconcile = False
            self.db = open_db(self.db_path)

    def _due_now(self, what: str, every: float, t: float) -> bool:
        if t >= self._due.get(what, 0.0):
            self._due[what] = t + every
            return True
        return False

    def _changed(self, key: str, value: Any) -> bool:
        if self._sent.get(key, _MISSING) == value:
            return False
        self._sent[key] = value
        return True

    def step(self, *, force: bool = False) -> list[Message]:
        """One round; the messages for what changed. Store errors become one StoreFailed."""
        return self.store_step(force=force) + self._machine()

    def store_step(self, *, force: bool = False) -> list[Message]:
        """The store's part of a round (the rest, GPU samples and host facts, is slower)."""
        out: list[Message] = []
        try:
            self._open()
            out += self._store(force)
        except Exception as exc:  # noqa: BLE001 - boundary: the UI shows it, the next round retries
            self.close()
            if self._changed("error", str(exc)):
                out.append(StoreFailed(str(exc)))
        return out

    def _store(self, force: bool) -> list[Message]:
        from ddtree.store.db import data_version
        from ddtree.store.downloads import recent_downloads
        from ddtree.store.queries import list_jobs, list_runs, recent_engines, runs_page, runs_signature
        from ddtree.store.sweeps import list_points

        db = self.db
        out: list[Message] = []
        version = data_version(db)
        watched = self.watched_run()
        stale = force or version != self._data_version
        self._data_version = version
        self._sent.pop("error", None)
        if stale:
            jobs = list_jobs(db, limit=MAX_ROWS)
            runs = list_runs(db, limit=MAX_ROWS)
            if self._changed("snapshot", (jobs, runs)):
                out.append(Snapshot(jobs, runs, self.sources.now()))
            downloads = recent_downloads(db, MAX_ROWS)
            if self._changed("downloads", downloads):
                out.append(DownloadsChanged(downloads))
            self._engines = recent_engines(db, MAX_ROWS)
            sig = runs_signature(db)
            if self._changed("runs_sig", sig):
                # The History pane's first page comes along (a few ms here), so opening the pane
                # draws it at once instead of after a query of its own.
                out.append(RunsChanged(sig, runs_page(db, limit=HISTORY_PAGE)))
        if watched is not None and (stale or self._sent.get("watched") != watched):
            points = list_points(db, watched)
            if self._changed("points", (watched, points)) or self._sent.get("watched") != watched:
                out.append(PointsChanged(watched, points))
            self._sent["watched"] = watched
        t = time.monotonic()
        running = tuple((r["id"], r.get("base_url")) for r in self._engines if r.get("state") == "running")
        if self._due_now("health", self.sources.health_s, t) or running != self._sent.get("running_engines"):
            self._sent["running_engines"] = running
            self._health = {row["id"]: (self.sources.health(row["base_url"])
                                        if row.get("state") == "running" and row.get("base_url") else None)
                            for row in self._engines}
        if self._changed("engines", (self._engines, self._health)):
            out.append(EnginesChanged(self._engines, dict(self._health)))
        return out

    def _machine(self) -> list[Message]:
        out: list[Message] = []
        t = time.monotonic()
        if self._due_now("sample", self.sources.sample_s, t):
            try:
                out.append(GpuSampled(self.sources.gpu_sample()))
            except Exception as exc:  # noqa: BLE001 - a driver fault must not stop the store poll
                out.append(GpuSampled(None))
                self._sent["sample_error"] = str(exc)
        if self._due_now("hardware", self.sources.hardware_s, t):
            try:
                view = self.sources.gpu_view()
                from ddtree.store.db import data_dir

                host = self.sources.host_info(data_dir(self.db_path))
            except Exception as exc:  # noqa: BLE001 - same: shown as unavailable, retried later
                view, host = None, None
                self._sent["hardware_error"] = str(exc)
            if self._changed("hardware", (_view_key(view), host)):
                out.append(HardwareChanged(view, host))
        return out

    def loop(self, post: Callable[[Message], Any], stop: threading.Event, interval_s: float = 0.5,
             wake: threading.Event | None = None) -> None:
        """Run rounds until `stop` is set; `wake` set by the UI forces an early round."""
        wake = wake or threading.Event()
        try:
            while not stop.is_set():
                force = wake.is_set()
                wake.clear()
                # The store's messages go first: on the first round the hardware part loads NVML
                # and friends, which should not hold back the jobs and runs.
                for message in self.store_step(force=force):
                    post(message)
                for message in self._machine():
                    post(message)
                wake.wait(interval_s)
        finally:
            self.close()


def _view_key(view: Any) -> Any:
    # a GpuView's `at` changes every read; compare what it shows
    if view is None:
        return None
    return (view.reason, view.driver_version, [(g.index, g.name, g.memory_used, g.util_gpu, g.temperature_c,
                                               g.power_w, len(g.processes)) for g in view.gpus])


_MISSING = object()
