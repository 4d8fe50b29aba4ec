"""A sweep's progress and its time to go, from the times its points actually took.

Pure functions over the points (or, when the points are not at hand, the run row): the Overview's
jobs listing uses them, and so can the Sweeps pane. The estimate is the median measured point
time times the points still to run, minus what the point in progress has already taken (a
median, so one slow first point, which also paid for the engine's start, does not skew it).
No Textual here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ddtree.console import fmt

FINISHED = ("done", "failed", "skipped")


@dataclass(frozen=True)
class SweepProgress:
    done: int
    total: int
    #: The median seconds a finished point took; None before one finished.
    per_point_s: float | None
    #: Seconds to go; None while nothing has been measured yet.
    eta_s: float | None
    #: The point being measured now (its index and a short label), or None.
    current: str | None = None

    def __post_init__(self) -> None:
        if self.done < 0 or self.total < 0 or self.done > self.total:
            raise ValueError(f"progress {self.done}/{self.total} is not a count of points")

    @property
    def text(self) -> str:
        """`9/14 points, ETA 2m30s` (or `ETA -` before a point has finished)."""
        return f"{self.done}/{self.total} points, ETA {fmt.duration(self.eta_s)}"


def point_label(p: Any) -> str:
    """`point 10: ddtree budget 32 c=4` (baselines read `point 1: ar c=1`)."""
    what = p.algorithm or "?"
    if p.budget is not None:
        what += f" budget {p.budget}"
    if p.concurrency is not None:
        what += f" c={p.concurrency}"
    if p.tp and p.tp > 1:
        what += f" tp{p.tp}"
    index = "" if p.idx is None else f" {p.idx + 1}"
    return f"point{index}: {what}"


def sweep_progress(points: list[Any], now: float, total: int | None = None) -> SweepProgress:
    """Progress and ETA from the points of one run (store.sweeps.Point or anything with
    state, started_at, ended_at, algorithm, budget, concurrency, tp, idx)."""
    total = max(len(points), total or 0)
    finished = [p for p in points if p.state in FINISHED]
    took = [p.ended_at - p.started_at for p in finished
            if p.state == "done" and p.started_at is not None and p.ended_at is not None and p.ended_at >= p.started_at]
    per = statistics.median(took) if took else None
    running = [p for p in points if p.state == "running"]
    to_go = total - len(finished) - len(running)
    eta = None
    if per is not None:
        eta = per * to_go
        for p in running:
            into = now - p.started_at if p.started_at is not None else 0.0
            eta += max(0.0, per - into)
    current = point_label(running[0]) if running else None
    return SweepProgress(done=len(finished), total=total, per_point_s=per, eta_s=eta, current=current)


def run_progress(run: Any, now: float) -> SweepProgress:
    """The same from the run row alone (points done and total, when it started): the time per point
    is the run's elapsed time over the points finished, so it includes engine starts."""
    total = run.points_total or 0
    done = min(total, (run.points_done or 0) + (run.points_failed or 0)) if total else 0
    per = eta = None
    started = run.started_at or run.created_at
    if done and started is not None:
        per = max(0.0, now - started) / done
        eta = per * (total - done) if run.ended_at is None else 0.0
    return SweepProgress(done=done, total=total, per_point_s=per, eta_s=eta)


def download_eta(row: dict, now: float) -> float | None:
    """A download's seconds to go now: its last estimate less the time since it was written, so the
    figure counts down between the downloader's updates instead of standing still."""
    eta = row.get("eta_s")
    if eta is None:
        return None
    at = row.get("updated_at")
    return eta if at is None else max(0.0, eta - max(0.0, now - at))
