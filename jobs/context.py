"""JobContext: what a job kind's `run(ctx, spec)` gets from its runner.

The methods are safe to call from any thread of the job; `ctx.db` itself is one connection,
meant for the job's own thread.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sqlite_utils import Database

from ddtree.jobs.errors import JobCancelled, JobError
from ddtree.jobs.procs import kill_group, start_time
from ddtree.store.db import data_dir as store_data_dir
from ddtree.jobs.logfile import create_log, open_log
from ddtree.store.db import logs_dir, open_db
from ddtree.store import jobs as store_jobs
from ddtree.store.redact import REDACTED

#: Progress writes closer together than this are coalesced (the last value always lands).
PROGRESS_MIN_INTERVAL_S = 0.2

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class _Child:
    name: str
    popen: subprocess.Popen
    row_id: int
    pid_started: float | None
    log: IO[bytes]
    log_path: Path
    ended: bool = False


class JobContext:
    """Handle of one running job: logging, progress, cancellation and child processes."""

    def __init__(self, job_id: int, db_path: str | os.PathLike, log_path: str | os.PathLike | None = None):
        self.job_id = int(job_id)
        self.db_path = str(db_path)
        self.data_dir: Path = store_data_dir(db_path)
        self.log_path = Path(log_path) if log_path else logs_dir(db_path) / f"job-{self.job_id}.log"
        #: Set when a cancel was requested; long work should wait on it or call check_cancelled().
        self.cancelled = threading.Event()
        #: The job's own connection, for the kind's thread.
        self.db: Database = open_db(db_path)
        # A second connection for the context's own writes, which may come from other threads
        # (the heartbeat), so they never interleave with a transaction of the kind on `db`.
        self._db: Database = open_db(db_path)
        self._lock = threading.RLock()
        self._children: list[_Child] = []
        self._progress: dict[str, Any] = {}
        self._progress_dirty = False
        self._progress_written_at = 0.0

    # -- logging and progress -------------------------------------------------------------

    def log(self, msg: str) -> None:
        """Append a timestamped line to the job's log file."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with self._lock, open_log(self.log_path, binary=False) as f:
            for line in str(msg).splitlines() or [""]:
                f.write(f"{stamp} {line}\n")

    def progress(self, done: float | None = None, total: float | None = None, message: str | None = None) -> None:
        """Record progress; arguments left as None keep their previous value."""
        with self._lock:
            if done is not None:
                self._progress["progress_done"] = float(done)
            if total is not None:
                self._progress["progress_total"] = float(total)
            if message is not None:
                self._progress["progress_message"] = str(message)
            self._progress_dirty = True
            if time.monotonic() - self._progress_written_at >= PROGRESS_MIN_INTERVAL_S:
                self.flush_progress()

    def flush_progress(self) -> None:
        with self._lock:
            if not self._progress_dirty:
                return
            store_jobs.set_progress(self._db, self.job_id, **self._progress)
            self._progress_dirty = False
            self._progress_written_at = time.monotonic()

    # -- cancellation ---------------------------------------------------------------------

    def check_cancelled(self) -> None:
        """Raise JobCancelled if a cancel was requested."""
        if self.cancelled.is_set():
            raise JobCancelled(f"job {self.job_id} was cancelled")

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake and raise JobCancelled as soon as a cancel is requested."""
        if self.cancelled.wait(max(0.0, seconds)):
            self.check_cancelled()

    # -- child processes ------------------------------------------------------------------

    def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        name: str,
    ) -> subprocess.Popen:
        """Start a child in its own process group, output to a new file data_dir/logs/job-<id>-<name>.log
        (`.2.log`, ... when that name is taken: see `child_log`).

        `env` adds to (and overrides) the runner's environment. The child is killed by group on
        cancel and when the job ends; a still-running child at job end is not an error.
        """
        if not _NAME_RE.match(name):
            raise JobError(f"bad process name {name!r}", "letters, digits, '.', '_' and '-' only")
        if not argv:
            raise JobError("empty command line for a child process")
        self.check_cancelled()
        full_env = None
        if env is not None:
            full_env = dict(os.environ)
            for key, value in env.items():
                if value == REDACTED:
                    # A secret the store holds redacted: the child inherits the real value from our
                    # environment (the CLI put it there, or the user exported it before a resume).
                    if str(key) not in os.environ:
                        self.log(f"{name}: {key} is redacted in the recipe and not set in the environment; "
                                 f"export {key} before resuming to give it to the engine")
                    continue
                full_env[str(key)] = str(value)
        log_path, log = create_log(self.log_path.parent, f"job-{self.job_id}-{name}")
        try:
            popen = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            log.close()
            raise JobError(f"cannot start {argv[0]}: {exc.strerror or exc}", "check the command and its path") from None
        started = start_time(popen.pid)
        with self._lock:
            row_id = store_jobs.add_process(self._db, self.job_id, name=name, argv=[str(a) for a in argv],
                                            pid=popen.pid, pid_started=started, log_path=str(log_path))
            self._children.append(_Child(name, popen, row_id, started, log, log_path))
        self.log(f"started {name} (pid {popen.pid}): {' '.join(str(a) for a in argv)}; log {log_path}")
        return popen

    def child_log(self, popen: subprocess.Popen) -> Path:
        """The log file `spawn` made for this child: it holds this launch's output and nothing else."""
        with self._lock:
            for child in self._children:
                if child.popen is popen:
                    return child.log_path
        raise JobError(f"pid {popen.pid} was not started by this job")

    def poll_children(self) -> None:
        """Record the exit of children that ended by themselves."""
        with self._lock:
            for child in self._children:
                if not child.ended and child.popen.poll() is not None:
                    self._mark_ended(child)

    def terminate_children(self, grace_s: float = 5.0) -> None:
        """SIGTERM each child's group, wait up to `grace_s`, SIGKILL what is left; reap them."""
        with self._lock:
            children = list(self._children)
        for child in children:
            if child.ended and child.popen.returncode is not None:
                # The leader is gone, but members of its group may live on (daemonised helpers).
                kill_group(child.popen.pid, grace_s, leader_started=child.pid_started)
                continue
            outcome = kill_group(child.popen.pid, grace_s, leader_started=child.pid_started, reap=child.popen.poll)
            try:
                child.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.log(f"{child.name} (pid {child.popen.pid}) did not exit after SIGKILL")
                continue
            if outcome in ("terminated", "killed"):
                self.log(f"{child.name} (pid {child.popen.pid}) {outcome}")
            with self._lock:
                self._mark_ended(child)

    def _mark_ended(self, child: _Child) -> None:
        if child.ended:
            return
        child.ended = True
        child.log.close()
        store_jobs.end_process(self._db, child.row_id, child.popen.returncode)

    def close(self, grace_s: float = 5.0) -> None:
        """End of job: stop the children, write the last progress, close the connection."""
        self.terminate_children(grace_s)
        self.flush_progress()
        self.db.close()
        self._db.close()
