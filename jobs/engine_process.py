"""One engine server under a job: started, located, waited for, its log read, stopped.

Both job kinds that run a server use it: `engine` (one server until it is cancelled) and `sweep`
(one per launch of its plan). The server is the job context's child (`ctx.spawn`: its own process
group, its own log) and has one `engines` row (store/engines.py) from `starting` to its end.

Where it listens: a builtin server picks its port and prints one JSON line on stdout, so into its
log, `{"event": "listening", "url": ..., "port": ..., "backend": ...}`; SGLang and vLLM announce
nothing and listen on the port of their launch spec. Ready: GET /health answers 200
(engine/serving/bench.wait_ready), polled so that cancelling the job ends the wait. A start that
fails is classified from the log (engine/serving/logclass: out of memory, NCCL, port in use,
missing model files ...), and that reason is the EngineStartFailed's message.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from ddtree.engine.machine.hw import format_cpulist
from ddtree.engine.serving.http import EngineNotReady
from ddtree.engine.serving.launch import LaunchSpec
from ddtree.engine.serving.logclass import classify_tail
from ddtree.jobs.errors import JobCancelled, JobError
from ddtree.jobs.logfile import error_tail
from ddtree.jobs.procs import kill_group
from ddtree.store import engines

#: Seconds a stopped server gets to exit after SIGTERM before its group is killed.
STOP_GRACE_S = 10.0
LOCATE_POLL_S = 0.2


class EngineStartFailed(JobError):
    """The server never became ready. `code` is the log classifier's (e.g. "port_in_use"), when
    it recognised the cause."""

    def __init__(self, message: str, hint: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message, hint)
        self.code = code


class _NotLocated(JobError):
    """The server exited, or did not say where it listens in time (classified into EngineStartFailed)."""


def log_tail(path: str | os.PathLike | None, lines: int = 3) -> str:
    """The lines of a server's log worth putting in an error (jobs/logfile.error_tail), else where the log is."""
    if not path:
        return "no engine log"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return f"see {path}"
    return error_tail(text, lines) or f"see {path}"


class _Announcement:
    """Reads a log as it grows until the `listening` JSON line appears (warm-up lines come first)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def poll(self) -> dict | None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return None
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if not (line.startswith("{") and '"listening"' in line):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "listening" and event.get("url"):
                return event
        return None


def pin_cpus(pid: int, cpus: tuple[int, ...]) -> str:
    """Pin every thread of a just-started child to `cpus` (for when neither numactl nor taskset
    exists). Threads and processes it starts later inherit the mask. Returns the line to log."""
    if not hasattr(os, "sched_setaffinity"):
        return "CPU affinity not set: this platform has no sched_setaffinity"
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    try:
        for task in tasks:
            os.sched_setaffinity(task, cpus)
    except OSError as exc:
        return f"CPU affinity not set: {exc.strerror or exc}"
    return f"CPU affinity of pid {pid} set to {format_cpulist(list(cpus))} by the runner (no numactl or taskset)"


class EngineProcess:
    """One launch of a server under a job context.

    `row` holds what the `engines` row says of the server (kind, model, algorithm, gpus, python,
    ...); the process adds its state, pid, log, address and end. `ready_timeout_s` bounds the
    whole wait, from the spawn to /health."""

    def __init__(self, ctx, spec: LaunchSpec, *, name: str, ready_timeout_s: float, row: dict) -> None:
        self.ctx, self.spec, self.name, self.ready_timeout_s = ctx, spec, name, ready_timeout_s
        self.row = dict(row)
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.row_id: int | None = None
        self.url: str | None = None
        self.backend: str | None = None  # what a builtin server's auto chose (its announcement says)

    def start(self) -> None:
        """Record the row, spawn the server and, where the launch asks the runner to, pin its CPUs."""
        self.row_id = engines.add_engine(self.ctx.db, {**self.row, "state": "starting", "created_at": time.time()})
        try:
            self.proc = self.ctx.spawn(list(self.spec.argv), env=dict(self.spec.env), name=self.name)
        except JobCancelled:
            raise  # the caller's stop() closes the row as stopped
        except BaseException as exc:
            self.end("failed", str(exc)[:500])
            raise
        self.log_path = self.ctx.child_log(self.proc)  # made for this launch: no older server's lines in it
        engines.update_engine(self.ctx.db, self.row_id, pid=self.proc.pid, pgid=self.proc.pid,
                              log_path=str(self.log_path))
        if self.spec.numa == "runner" and self.spec.cpu_affinity:
            # At once: the interpreter is still starting, long before SGLang spawns its workers.
            self.ctx.log(f"engine {self.name}: {pin_cpus(self.proc.pid, self.spec.cpu_affinity)}")

    def exited(self) -> str | None:
        """None while the server runs; else its exit code and where its log is."""
        if self.proc is None:
            return "not started"
        code = self.proc.poll()
        return None if code is None else f"exit code {code}; see {self.log_path}"

    def _alive(self) -> str | None:
        self.ctx.check_cancelled()  # the health wait sleeps outside the job context: a cancel ends it here
        return self.exited()

    def wait_ready(self, *, health: bool = True) -> str:
        """Where the server listens, once it serves; its URL. `health` False takes a builtin
        server's announcement as ready (it announces once warmed up and bound); SGLang and vLLM
        are always asked /health. Raises EngineStartFailed with the cause read from the log,
        JobCancelled when the job is cancelled meanwhile."""
        from ddtree.engine.serving.bench import wait_ready  # aiohttp and all: not for the console's engine form

        t0 = time.monotonic()
        try:
            url = self._locate(t0) if self.spec.announces_url else self.spec.base_url
            if health or not self.spec.announces_url:
                remaining = max(1.0, self.ready_timeout_s - (time.monotonic() - t0))
                wait_ready(url, timeout_s=remaining, alive=self._alive)
        except (EngineNotReady, _NotLocated) as exc:
            verdict = classify_tail(self.log_path)
            reason = verdict.describe() if verdict else str(exc)
            self.end("failed", reason)
            raise EngineStartFailed(reason, code=verdict.code if verdict else None) from None
        self.url = url
        ready = {"state": "running", "base_url": url, "port": int(url.rsplit(":", 1)[1]), "ready_at": time.time()}
        if self.backend is not None:
            ready["backend"] = self.backend
        engines.update_engine(self.ctx.db, self.row_id, **ready)
        return url

    def _locate(self, t0: float) -> str:
        """The builtin server's announced URL, read from its log."""
        reader = _Announcement(self.log_path)
        while True:
            event = reader.poll()
            if event is not None:
                if isinstance(event.get("backend"), str):
                    self.backend = event["backend"]
                return str(event["url"])
            gone = self.exited()
            if gone:
                raise _NotLocated(f"engine exited while starting ({gone})", log_tail(self.log_path))
            if time.monotonic() - t0 > self.ready_timeout_s:
                raise _NotLocated(f"engine did not report a listening address within {self.ready_timeout_s:g}s",
                                  f"raise engine.ready_timeout_s, or read {self.log_path}")
            self.ctx.sleep(LOCATE_POLL_S)

    def died_reason(self) -> str | None:
        """Why the server exited (classified from its log), or None while it runs."""
        gone = self.exited()
        if not gone:
            return None
        verdict = classify_tail(self.log_path)
        return f"{gone}: {verdict.describe()}" if verdict else gone

    def end(self, state: str, error: str | None = None) -> None:
        """Close the row as `state` (a row already `failed` keeps its cause)."""
        if self.row_id is not None:
            engines.end_engine(self.ctx.db, self.row_id, state, error, time.time())

    def stop(self, state: str | None = None, error: str | None = None) -> None:
        """SIGTERM the server's group, SIGKILL it after STOP_GRACE_S, and close the row: as
        `state` when given, else `failed` with the cause when it had died, `stopped` when not."""
        if self.proc is None:
            self.end(state or "stopped", error)
            return
        died = self.died_reason()
        if self.proc.poll() is None:
            kill_group(self.proc.pid, STOP_GRACE_S, reap=self.proc.poll)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.ctx.log(f"engine {self.name} (pid {self.proc.pid}) did not exit after SIGKILL")
        self.ctx.poll_children()
        if state is None:
            state, error = ("failed", died) if died else ("stopped", None)
        self.end(state, error)
