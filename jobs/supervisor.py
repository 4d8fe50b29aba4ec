"""Starting, cancelling, waiting for and reconciling jobs (called by the CLI and the console)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddtree.jobs.errors import JobStateError, RunnerStartError
from ddtree.jobs.kinds import validate_spec
from ddtree.jobs.logfile import open_log
from ddtree.jobs.model import create_job, hostname, set_state
from ddtree.jobs.procs import is_alive, kill_group, same_leader, signal_group
from ddtree.jobs.runner import HEARTBEAT_STALE_S, run_job
from ddtree.store import jobs as store_jobs
from ddtree.store.db import open_db, resolve_db_path
from ddtree.store.downloads import close_downloads, close_downloads_of_ended_jobs
from ddtree.store.queries import close_engines, get_job, job_processes, list_jobs, now
from ddtree.store.records import ACTIVE_STATES, Job
from ddtree.store.redact import secret_env

#: A queued job whose runner has not recorded itself after this long is presumed never started.
QUEUED_STALE_S = 120.0

#: How long `submit` waits for the launcher process (it forks and exits at once).
LAUNCH_TIMEOUT_S = 30.0


def submit(
    db_path: str | os.PathLike | None,
    kind: str,
    spec: dict,
    *,
    name: str | None = None,
    detach: bool = True,
    secrets: dict[str, str] | None = None,
) -> int:
    """Validate `spec`, write a queued job and run it; return the job id.

    detach=True: start `python -m ddtree.jobs.run JOB_ID --db DB --detach` in a new session and
    return at once (the job outlives this process). detach=False: run it here, in the
    foreground, and return when it has ended (SIGINT/SIGTERM cancel it).

    Secret-looking `env` values in `spec` (store/redact.py), and `secrets` (those of a run's recipe,
    which the store holds redacted), are stored as `<redacted>` and reach the runner only through
    its environment, from which its engines inherit them.
    """
    path = resolve_db_path(db_path)
    spec = validate_spec(kind, spec)
    secrets = {**secret_env(spec), **(secrets or {})}
    db = open_db(path)
    try:
        job_id = create_job(db, kind, spec, name=name)
        log_path = get_job(db, job_id).log_path
    finally:
        db.close()
    if not detach:
        with _environment(secrets):
            run_job(str(path), job_id, detached=False)
        return job_id
    _launch(path, job_id, Path(log_path), secrets)
    return job_id


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with `values` set for the duration (a foreground runner is this process)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch(path: Path, job_id: int, log_path: Path, secrets: dict[str, str] | None = None) -> None:
    argv = [sys.executable, "-m", "ddtree.jobs.run", str(job_id), "--db", str(path), "--detach"]
    with open_log(log_path) as log:
        try:
            launcher = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **secrets} if secrets else None,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            _fail_start(path, job_id, f"cannot start the runner: {exc}")
            raise RunnerStartError(f"cannot start the runner for job {job_id}: {exc}") from None
    try:
        code = launcher.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        code = -9
    if code != 0:
        _fail_start(path, job_id, f"runner launcher exited with {code}")
        raise RunnerStartError(f"the runner for job {job_id} did not start (exit {code})", f"see {log_path}")


def _fail_start(path: Path, job_id: int, message: str) -> None:
    db = open_db(path)
    try:
        try:
            set_state(db, job_id, "failed", message)
        except JobStateError:
            pass  # the runner got further than we thought; its own record stands
    finally:
        db.close()


def wait(db_path: str | os.PathLike | None, job_id: int, timeout: float | None = None, poll_s: float = 0.1) -> Job:
    """Poll the store until the job is in a terminal state (or `timeout` passes); return it."""
    db = open_db(db_path)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = get_job(db, job_id)
            if job.terminal or (deadline is not None and time.monotonic() >= deadline):
                return job
            time.sleep(poll_s)
    finally:
        db.close()


def cancel(db_path: str | os.PathLike | None, job_id: int, grace_s: float = 10.0) -> Job:
    """Cancel a job: SIGTERM its runner's group, wait `grace_s`, then SIGKILL runner and children.

    Raises NotFound for an unknown id and JobStateError (exit 2) for a job that already ended.
    Returns the job as it is afterwards.
    """
    db = open_db(db_path)
    try:
        job = get_job(db, job_id)
        if job.terminal:
            raise JobStateError(f"job {job_id} already {job.state}", "only queued or running jobs can be cancelled")
        store_jobs.request_cancel(db, job_id, grace_s)
        job = get_job(db, job_id)
        if job.pid is None:
            try:
                return set_state(db, job_id, "cancelled", "cancelled before its runner started")
            except JobStateError:
                job = get_job(db, job_id)  # the runner started meanwhile: signal it below
                if job.terminal:
                    return job
        if job.host not in (None, hostname()):
            # The heartbeat of the runner on that host sees cancel_requested_at and stops.
            return job
        if is_alive(job.pid, job.pid_started):
            _signal_runner(job, signal.SIGTERM)
            deadline = time.monotonic() + max(0.0, grace_s)
            while time.monotonic() < deadline:
                job = get_job(db, job_id)
                if job.terminal and not is_alive(job.pid, job.pid_started):
                    close_engines(db, job_id, "stopped", "its job was cancelled")  # rows its runner left open
                    return job
                time.sleep(0.05)
            job = get_job(db, job_id)
            if is_alive(job.pid, job.pid_started):
                _signal_runner(job, signal.SIGKILL)
        _kill_children(db, job_id, grace_s=0.0)
        job = get_job(db, job_id)
        if not is_alive(job.pid, job.pid_started):
            # A runner killed before it closed its engine rows: they would read `running` forever.
            close_engines(db, job_id, "stopped", "its job was cancelled")
        if job.terminal:
            return job
        try:
            return set_state(db, job_id, "cancelled", f"runner did not stop within {grace_s:g} s; killed")
        except JobStateError:
            return get_job(db, job_id)
    finally:
        db.close()


def _signal_runner(job: Job, sig: int) -> None:
    if job.pgid:
        if same_leader(job.pgid, job.pid_started if job.pgid == job.pid else None):
            signal_group(job.pgid, sig)
    else:
        # A foreground runner shares its terminal's process group: signal only the runner.
        try:
            os.kill(job.pid, sig)
        except ProcessLookupError:
            pass


def _kill_children(db, job_id: int, grace_s: float) -> None:
    """Stop child process groups a dead runner left behind, and close their rows."""
    for proc in job_processes(db, job_id, running_only=True):
        kill_group(proc.pgid or proc.pid, grace_s, leader_started=proc.pid_started)
        store_jobs.close_process(db, proc.id)


def reconcile(db_path: str | os.PathLike | None, stale_s: float = HEARTBEAT_STALE_S) -> list[int]:
    """Mark `lost` the active jobs of this host whose runner is gone and whose heartbeat is older
    than `stale_s`; stop the children they left and close their open engine and download rows
    (state lost).
    Returns the ids marked lost."""
    db = open_db(db_path)
    lost = []
    try:
        me = hostname()
        t = now()
        for job in list_jobs(db, states=set(ACTIVE_STATES)):
            if job.host not in (None, me):
                continue
            if job.pid is None:
                if job.state == "queued" and t - job.created_at > QUEUED_STALE_S:
                    reason = "its runner never started"
                else:
                    continue
            elif is_alive(job.pid, job.pid_started):
                continue
            elif job.heartbeat_at is not None and t - job.heartbeat_at <= stale_s:
                continue
            else:
                reason = f"its runner (pid {job.pid}) is gone"
            _kill_children(db, job.id, grace_s=1.0)
            try:
                set_state(db, job.id, "lost", reason)
                lost.append(job.id)
            except JobStateError:
                continue  # it ended on its own meanwhile
            # Its servers were just stopped with its children; their rows say so, like the job's.
            close_engines(db, job.id, "lost", f"job {job.id} was lost: {reason}")
            close_downloads(db, job.id, "lost", f"job {job.id} was lost: {reason}")
        close_downloads_of_ended_jobs(db)
    finally:
        db.close()
    return lost
