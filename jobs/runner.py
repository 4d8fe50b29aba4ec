"""The runner's work: `run_job(db_path, job_id)` runs one queued job to its end.

It records its pid, heartbeats, runs the kind in a worker thread, turns SIGTERM/SIGINT/SIGHUP
into a cancel, stops its children by process group, and records the outcome through set_state.
The process entry point is ddtree.jobs.run.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import traceback
from typing import Any

from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import JobCancelled, JobError, JobStateError
from ddtree.jobs.kinds import load_kind
from ddtree.jobs.model import CANCELLED_REASON, hostname, set_state
from ddtree.jobs.procs import start_time
from ddtree.store import jobs as store_jobs
from ddtree.store.db import open_db
from ddtree.store.errors import StoreError
from ddtree.store.queries import get_job

#: Seconds between heartbeats; a runner silent for HEARTBEAT_STALE_S is presumed dead.
HEARTBEAT_S = 2.0
HEARTBEAT_STALE_S = 15.0

#: How long children get between SIGTERM and SIGKILL when a cancel carries no grace.
DEFAULT_CHILD_GRACE_S = 5.0



class _Heartbeat(threading.Thread):
    def __init__(self, ctx: JobContext) -> None:
        super().__init__(name=f"heartbeat-{ctx.job_id}", daemon=True)
        self.ctx = ctx
        self.stop = threading.Event()
        self.cancel_grace_s: float | None = None

    def run(self) -> None:
        db = open_db(self.ctx.db_path)
        try:
            while not self.stop.wait(HEARTBEAT_S):
                self.beat(db)
        finally:
            db.close()

    def beat(self, db) -> None:
        try:
            store_jobs.record_heartbeat(db, self.ctx.job_id)
            request = store_jobs.cancel_request(db, self.ctx.job_id)
            if request is not None and not self.ctx.cancelled.is_set():
                self.cancel_grace_s = request[1]
                self.ctx.log("cancel requested (seen in the store)")
                self.ctx.cancelled.set()
            self.ctx.poll_children()
            self.ctx.flush_progress()
        except (sqlite3.Error, StoreError) as exc:
            # A missed beat is harmless; the next one retries.
            self.ctx.log(f"heartbeat failed: {exc}")


def _child_grace(db, job_id: int) -> float:
    grace = store_jobs.cancel_grace(db, job_id)
    if grace is not None:
        # Finish well inside the canceller's own grace, which ends in SIGKILL for us.
        return max(0.2, min(DEFAULT_CHILD_GRACE_S, 0.5 * grace))
    return DEFAULT_CHILD_GRACE_S


def run_job(db_path: str, job_id: int, *, detached: bool = True) -> int:
    """Run queued job `job_id` in this process until it ends. Returns 0 if it succeeded."""
    db = open_db(db_path)
    try:
        job = get_job(db, job_id)
        if job.state != "queued":
            return 0 if job.state == "succeeded" else 1
        pid = os.getpid()
        store_jobs.record_runner(db, job_id, pid=pid, pgid=os.getpgid(0) if detached else None,
                                 pid_started=start_time(pid), host=hostname())
        try:
            set_state(db, job_id, "starting", f"runner pid {pid}")
        except JobStateError:
            return 1  # cancelled before we got here
        return _supervise(db, db_path, job_id, job.kind, job.spec or {}, job.log_path)
    finally:
        db.close()


def _supervise(db, db_path: str, job_id: int, kind: str, spec: dict, log_path: str | None) -> int:
    ctx = JobContext(job_id, db_path, log_path)
    old_handlers = _install_signal_handlers(ctx)
    heartbeat = _Heartbeat(ctx)
    heartbeat.start()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def work(module) -> None:
        try:
            outcome["result"] = module.run(ctx, spec)
        except BaseException as exc:  # boundary: the outcome is recorded below
            outcome["error"] = exc
            outcome["traceback"] = traceback.format_exc()
        finally:
            done.set()

    try:
        try:
            module = load_kind(kind)
        except JobError as exc:
            ctx.log(f"failed: {exc}")
            heartbeat.stop.set()
            heartbeat.join(timeout=10)
            ctx.close()
            set_state(db, job_id, "failed", str(exc))
            return 1
        set_state(db, job_id, "running")
        ctx.log(f"running {kind} job {job_id}")
        worker = threading.Thread(target=work, args=(module,), name=f"job-{job_id}", daemon=True)
        worker.start()
        while not done.wait(0.2):
            if ctx.cancelled.is_set():
                ctx.log("cancelling: stopping child processes")
                ctx.terminate_children(_child_grace(db, job_id))
                # Give the kind a moment to notice and return; it cannot be interrupted.
                done.wait(2.0)
                break
        grace = _child_grace(db, job_id) if ctx.cancelled.is_set() else DEFAULT_CHILD_GRACE_S
        # Stop the heartbeat first: it writes through the context, which close() shuts.
        heartbeat.stop.set()
        heartbeat.join(timeout=10)
        ctx.close(grace)
        return _record(db, ctx, job_id, outcome, done.is_set())
    finally:
        heartbeat.stop.set()
        _restore_signal_handlers(old_handlers)


def _record(db, ctx: JobContext, job_id: int, outcome: dict, finished: bool) -> int:
    error = outcome.get("error")
    try:
        if ctx.cancelled.is_set() or isinstance(error, JobCancelled):
            ctx.log("cancelled" + ("" if finished else " (the job did not return in time)"))
            set_state(db, job_id, "cancelled", CANCELLED_REASON, result=outcome.get("result"))
            return 1
        if error is not None:
            message = str(error) if isinstance(error, JobError) else f"{type(error).__name__}: {error}"
            ctx.log(f"failed: {message}")
            if not isinstance(error, JobError):
                ctx.log(outcome.get("traceback", ""))
            set_state(db, job_id, "failed", message)
            return 1
        ctx.log("succeeded")
        set_state(db, job_id, "succeeded", result=outcome.get("result"))
        return 0
    except JobStateError as exc:
        # Someone else (a cancel past its grace, a reconcile) already ended the job.
        ctx.log(f"outcome not recorded: {exc}")
        return 1


def _install_signal_handlers(ctx: JobContext) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame) -> None:
        ctx.cancelled.set()

    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)
    return old


def _restore_signal_handlers(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


def mark_failed(db_path: str, job_id: int, message: str) -> None:
    db = open_db(db_path)
    try:
        job = get_job(db, job_id)
        if not job.terminal:
            set_state(db, job_id, "failed", message)
    finally:
        db.close()
