"""A server subprocess that announces itself on stdout (the builtin server, `ddtree-console serve`,
a bench script's stand-in): started in its own process group with its stderr in a log file."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path
import time

CLI = [sys.executable, "-m", "ddtree.console.cli"]
SERVER = [sys.executable, "-m", "ddtree.engine.reference.server"]

#: What tests run servers with: one thread each, so a 2-core box is not oversubscribed.
TEST_ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


class ServerProcess:
    """Starts `argv` and waits for its `{"event": "listening", "url": ...}` line; every stdout line
    before it is a JSON warm-up step (kept in .warmup). `env` is added to this process's environment
    (TEST_ENV unless given; bench scripts pass {} to keep their thread settings)."""

    def __init__(self, argv: list[str], log_path: Path, timeout_s: float = 120.0, env: dict | None = None) -> None:
        self.log_path = Path(log_path)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, start_new_session=True,
                                     env={**os.environ, **(TEST_ENV if env is None else env)})
        self.warmup: list[dict] = []
        self.announcement = self._read_announcement(timeout_s)
        self.url = self.announcement["url"]
        self.port = self.announcement.get("port")

    def _read_announcement(self, timeout_s: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if not line:
                    break
                event = json.loads(line)
                if event.get("event") == "listening":
                    return event
                self.warmup.append(event)
        self.stop()
        raise RuntimeError(f"server did not announce itself; log {self.log_path}:\n"
                           f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL to the whole group after `timeout_s`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        return self.proc.returncode
