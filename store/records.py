"""Typed records: small frozen dataclasses built from rows.

`from_row` ignores columns a record does not know, so a later migration that adds columns does
not break older readers; JSON columns are decoded (a malformed document becomes None).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, TypeVar

#: Job states, in lifecycle order. Terminal states never change again.
JOB_STATES = ("queued", "starting", "running", "succeeded", "failed", "cancelled", "lost")
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "lost"})
ACTIVE_STATES = frozenset({"queued", "starting", "running"})

R = TypeVar("R")


def decode_json(text: str | None) -> Any:
    if text is None or text == "":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def from_row(cls: type[R], row: dict[str, Any]) -> R:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    json_cols = getattr(cls, "JSON_COLUMNS", ())
    kwargs = {}
    for key, value in row.items():
        if key not in names:
            continue
        kwargs[key] = decode_json(value) if key in json_cols else value
    return cls(**kwargs)


@dataclass(frozen=True)
class Job:
    JSON_COLUMNS = ("spec", "result")

    id: int
    kind: str
    state: str
    created_at: float
    name: str | None = None
    spec: dict | None = None
    result: Any = None
    host: str | None = None
    pid: int | None = None
    pgid: int | None = None
    pid_started: float | None = None
    log_path: str | None = None
    progress_done: float | None = None
    progress_total: float | None = None
    progress_message: str | None = None
    heartbeat_at: float | None = None
    cancel_requested_at: float | None = None
    cancel_grace_s: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}-{self.id}"

@dataclass(frozen=True)
class JobEvent:
    id: int
    job_id: int
    at: float
    state: str
    message: str | None = None


@dataclass(frozen=True)
class Process:
    JSON_COLUMNS = ("argv",)

    id: int
    job_id: int
    name: str
    pid: int
    started_at: float
    argv: list | None = None
    pgid: int | None = None
    pid_started: float | None = None
    log_path: str | None = None
    ended_at: float | None = None
    returncode: int | None = None


@dataclass(frozen=True)
class Run:
    JSON_COLUMNS = ("recipe", "hardware", "software")

    id: int
    created_at: float
    job_id: int | None = None
    name: str | None = None
    recipe: Any = None
    recipe_path: str | None = None
    recipe_git_rev: str | None = None
    engine_kind: str | None = None
    model: str | None = None
    draft_model: str | None = None
    hardware: Any = None
    software: Any = None
    state: str | None = None
    points_total: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    #: Filled by `list_runs` (not a column): points of this run by state.
    points_done: int = 0
    points_failed: int = 0
