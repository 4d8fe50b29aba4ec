"""py-spy around a measured part of a benchmark (bench_server.py --py-spy): where a process's
threads spend a cell, to compare the server's engine process with the same loop in process.

Two recorders per part, both without pausing the process (--nonblocking), 500 samples a second,
collapsed stacks with thread ids (--format raw --threads): STEM-NAME.txt has every thread's
samples, waits included (--idle); STEM-NAME-gil.txt only the thread that holds the GIL. Read them
with bench/py_spy_summary.py. The py-spy binary comes from PATH, beside sys.executable, or from
bin/ of a sys.path entry (pip install --target puts it there). What py-spy says on stderr goes to
STEM-NAME.log, so a refused attach (ptrace rights) is on record rather than lost.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator


def binary() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    for base in [str(Path(sys.executable).parent), *(str(Path(p) / "bin") for p in sys.path if p)]:
        candidate = Path(base) / "py-spy"
        if candidate.is_file():
            return str(candidate)
    return None


@contextlib.contextmanager
def sampled(stem: str | None, pid: int | None, name: str) -> Iterator[None]:
    """Record process `pid` while the block runs; a no-op without a stem or a pid."""
    exe = binary() if stem and pid else None
    if exe is None:
        if stem and pid:
            print("py-spy: not found; no samples recorded", flush=True)
        yield
        return
    log = open(f"{stem}-{name}.log", "w")
    recorders = [subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "500", "--nonblocking", "--threads",
                                   "--format", "raw", "-o", f"{stem}-{name}{suffix}.txt", *extra],
                                  stdout=log, stderr=log)
                 for suffix, extra in (("", ["--idle"]), ("-gil", ["--gil"]))]
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        for recorder in recorders:
            try:
                recorder.wait(30)
            except subprocess.TimeoutExpired:
                recorder.kill()
        log.close()
