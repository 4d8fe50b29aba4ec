"""Process-group plumbing shared by the runner and the supervisor.

A pid alone is not an identity: after a reboot or a long uptime it is reused. Rows therefore
store the process start time next to the pid, and nothing here signals a pid whose start time
differs from the recorded one.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psutil

# Start times are computed from boot time plus clock ticks; two readings of the same process
# agree to well under this.
_START_TIME_TOLERANCE_S = 0.5


def start_time(pid: int) -> float | None:
    """The start time of process `pid` (epoch seconds), or None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def is_alive(pid: int | None, started: float | None = None) -> bool:
    """True if `pid` runs, is not a zombie, and (when given) started at `started`."""
    if not pid or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if started is not None and abs(proc.create_time() - started) > _START_TIME_TOLERANCE_S:
            return False
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return True


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _group_has_live_member(pgid)


def _group_has_live_member(pgid: int) -> bool:
    # killpg(…, 0) succeeds while only zombies are left (their parent has not reaped them yet);
    # those are dead for our purposes.
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied, PermissionError):
            continue
    return False


def same_leader(pgid: int, leader_started: float | None) -> bool:
    """False when the group's leader pid now belongs to a different process (pid reused)."""
    if leader_started is None:
        return True
    now_started = start_time(pgid)
    return now_started is None or abs(now_started - leader_started) <= _START_TIME_TOLERANCE_S


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_group(
    pgid: int,
    grace_s: float,
    *,
    leader_started: float | None = None,
    reap: Callable[[], object] | None = None,
) -> str:
    """SIGTERM the group, wait up to `grace_s` for it to empty, then SIGKILL it.

    `reap` (e.g. a Popen's poll) is called while waiting so our own child does not linger as a
    zombie. Returns "gone" (nothing to do), "terminated", "killed", or "skipped" (pid reused).
    """
    if not same_leader(pgid, leader_started):
        return "skipped"
    if not signal_group(pgid, signal.SIGTERM):
        return "gone"
    deadline = time.monotonic() + max(0.0, grace_s)
    while True:
        if reap is not None:
            reap()
        if not group_exists(pgid):
            return "terminated"
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    signal_group(pgid, signal.SIGKILL)
    for _ in range(100):
        if reap is not None:
            reap()
        if not group_exists(pgid):
            break
        time.sleep(0.02)
    return "killed"
