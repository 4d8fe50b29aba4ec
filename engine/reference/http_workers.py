"""The HTTP workers a builtin server starts beside itself (--tokenizer-worker-num): each is the
server's own command line with `--http-worker-of PORT,FD,PID,READY`, binds its own socket to the
port (SO_REUSEPORT) and talks to the one engine process over the socket FD; it writes a byte to
the pipe READY once it serves. The server announces itself only after every worker has (so a
client's first connections are spread over all of them), tells them to drain when it is told to,
waits for them before its engine stops, and logs one that dies. Nothing here imports torch."""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("ddtree.engine.server")


class HttpWorkers:
    def __init__(self, module: str, argv: list[str], port: int, conns: list) -> None:
        """Start a worker for each of `conns` (the engine's sockets past the server's own)."""
        self.stopping = threading.Event()
        self.procs: list[subprocess.Popen] = []
        self.lost: set[int] = set()  # pids of workers that died while the server ran (logged then)
        self._ready: list[int] = []  # each worker's end of its READY pipe, ours to read
        for conn in conns:
            ready, told = os.pipe()
            tag = f"{port},{conn.fileno()},{os.getpid()},{told}"
            self.procs.append(subprocess.Popen([sys.executable, "-m", module, *argv, "--http-worker-of", tag],
                                               pass_fds=(conn.fileno(), told)))
            conn.close()
            os.close(told)
            self._ready.append(ready)
        for proc in self.procs:
            threading.Thread(target=self._watch, args=(proc,), name="http-worker-watch", daemon=True).start()

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every worker serves, or has failed to (logged), at most timeout_s."""
        deadline = time.monotonic() + timeout_s
        for proc, ready in zip(self.procs, self._ready):
            readable, _, _ = select.select([ready], [], [], max(0.0, deadline - time.monotonic()))
            if not readable or not os.read(ready, 1):
                log.warning("an HTTP worker (pid %s) did not start serving; the server goes on without it",
                            proc.pid)
            os.close(ready)
        self._ready = []

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping.is_set():
            self.lost.add(proc.pid)
            log.warning("an HTTP worker (pid %s) exited with code %s; the server serves on without it",
                        proc.pid, code)

    def drain(self) -> None:
        """Pass the server's stop on (SIGTERM, as a signal to the process group already does):
        each worker stops accepting and finishes its requests while the server does."""
        if self.stopping.is_set():
            return  # once: a worker past its drain has its default handlers back, and would die of a second
        self.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float) -> None:
        """Drain them and wait until they have gone, at most timeout_s (then kill): the engine
        serves their requests until then."""
        self.drain()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("an HTTP worker (pid %s) did not stop; killing it", proc.pid)
                proc.kill()
                code = proc.wait()
            if code != 0 and proc.pid not in self.lost:
                log.warning("an HTTP worker (pid %s) exited with code %s", proc.pid, code)
