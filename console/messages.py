"""Messages the store poller posts to the app; each carries only what changed since the last one.

They are posted from the poller's thread (`post_message` is thread-safe) and handled on the UI
thread, where the app keeps the latest value of each in a `var` that panes watch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:  # the store imports sqlite-utils, which the first frame does without
    from ddtree.store.records import Job, Run


@dataclass
class Snapshot(Message):
    """Jobs and recent runs, posted when either changed (the minimal console's message, kept)."""

    jobs: list[Job]
    runs: list[Run]
    at: float


@dataclass
class DownloadsChanged(Message):
    rows: list[dict]


@dataclass
class EnginesChanged(Message):
    rows: list[dict]
    #: engine row id -> True (healthy), False (not answering), None (not checked: not running)
    health: dict[int, bool | None] = field(default_factory=dict)


@dataclass
class PointsChanged(Message):
    """The points of the run the Sweeps pane shows."""

    run_id: int
    points: list[Any]


@dataclass
class RunsChanged(Message):
    """Some run was added or changed; the History pane reloads its (filtered) page."""

    signature: tuple
    #: The History pane's default page (newest first, no filter) as of this change: (rows, total).
    page: tuple[list[dict], int] | None = None


@dataclass
class GpuSampled(Message):
    """One telemetry tick (a `ddtree.engine.machine.sampler.TelemetrySample`)."""

    sample: Any

    def can_replace(self, message: Message) -> bool:
        # a slow UI keeps only the newest sample instead of a backlog
        return isinstance(message, GpuSampled)


@dataclass
class HardwareChanged(Message):
    """The GPU view (`GpuView`) and host facts (`HostInfo`), refreshed every few seconds."""

    view: Any
    host: Any


@dataclass
class StoreFailed(Message):
    """The poller could not read the store; the status line says why."""

    error: str
