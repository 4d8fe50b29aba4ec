"""Runs and points of sweeps: the writes a sweep runner makes and the reads export and the console make.

A point row is created `pending` for every planned grid cell when a run starts (or resumes), keyed
by (run_id, point_key) under a unique index, so a resume finds the row it left behind and can never
add a second one. A point's result and its requests land in one transaction.

Point states: pending -> running -> done | failed | skipped (saturated, or its engine never came up).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlite_utils import Database

from ddtree.store.db import transaction
from ddtree.store.errors import NotFound, StoreError
from ddtree.store import queries, stats
from ddtree.store.stats import UNSTABLE_CV
from ddtree.store.summary import cell_of, cell_rows, setting_of
from ddtree.store.queries import fetch_rows, to_json
from ddtree.store.records import Run, from_row
from ddtree.store.redact import redact

def cell_key(point_key: str) -> str:
    """The grid cell a point key belongs to: the key less its repeat (the repeats of a cell share it)."""
    params = json.loads(point_key)
    params.pop("repeat", None)
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


POINT_STATES = ("pending", "running", "done", "failed", "skipped")
FINISHED_POINT_STATES = frozenset({"done", "skipped"})

#: The metric columns `record_point` fills from a metrics dict (names as engine/bench.point_metrics).
METRIC_COLUMNS = (
    "requests_ok", "requests_failed", "output_tokens", "duration_s", "output_tok_s", "req_s", "tok_s_per_user",
    "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99",
    "tau_mean", "tau_weighted", "gpu_util_mean", "gpu_power_mean",
)
PARAM_COLUMNS = ("engine_kind", "algorithm", "budget", "tp", "gpus", "concurrency", "dataset", "temperature",
                 "repeat")


class StoreFull(StoreError):
    """The disk (or the database's size limit) is full; nothing of the failed write was kept."""


@dataclass(frozen=True)
class Point:
    JSON_COLUMNS = ("gpus", "tau_hist", "failures", "warnings", "contention")

    id: int
    run_id: int
    point_key: str | None = None
    idx: int | None = None
    engine_kind: str | None = None
    algorithm: str | None = None
    budget: int | None = None
    block_size: int | None = None
    tp: int | None = None
    gpus: Any = None
    concurrency: int | None = None
    dataset: str | None = None
    temperature: float | None = None
    repeat: int | None = None
    baseline: int | None = None
    num_prompts: int | None = None
    max_new_tokens: int | None = None
    state: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    requests_ok: int | None = None
    requests_failed: int | None = None
    output_tokens: int | None = None
    duration_s: float | None = None
    output_tok_s: float | None = None
    req_s: float | None = None
    tok_s_per_user: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p90: float | None = None
    itl_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p90: float | None = None
    e2e_p99: float | None = None
    tau_mean: float | None = None
    tau_weighted: float | None = None
    tau_hist: Any = None
    speedup_vs_ar: float | None = None
    speedup_vs_dflash: float | None = None
    gpu_util_mean: float | None = None
    gpu_power_mean: float | None = None
    failures: Any = None
    warnings: Any = None
    repeat_spread: float | None = None
    unstable: int | None = None
    error: str | None = None
    cell_key: str | None = None
    cv: float | None = None
    contention: Any = None  # JSON: what competed with the point (store/contention.py)
    contended: int | None = None

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@contextlib.contextmanager
def write(db: Database, what: str) -> Iterator[Database]:
    """A write transaction whose full-disk failure becomes StoreFull (the transaction rolls back);
    `what` names what was being saved in the error."""
    try:
        with transaction(db) as tx:
            yield tx
    except sqlite3.OperationalError as exc:
        raise _classify(exc, what) from None




def _classify(exc: sqlite3.OperationalError, what: str) -> StoreError:
    text = str(exc)
    if "full" in text:
        return StoreFull(f"cannot save {what}: {text}", "free disk space where the database lives, then resume the run")
    if "readonly" in text or "read-only" in text:
        return StoreError(f"cannot save {what}: the database is read-only",
                          "make the file and its folder writable, or pass another path with --db or DDTREE_DB")
    return StoreError(f"cannot save {what}: {text}")


# -- runs ----------------------------------------------------------------------------------------


def create_run(db: Database, *, job_id: int | None, name: str, recipe: dict, recipe_path: str | None = None,
               recipe_git_rev: str | None = None, engine_kind: str | None = None, model: str | None = None,
               draft_model: str | None = None, hardware: Any = None, software: Any = None,
               points_total: int | None = None) -> int:
    now = time.time()
    values = {"job_id": job_id, "name": name, "recipe": to_json(redact(recipe)), "recipe_path": recipe_path,
              "recipe_git_rev": recipe_git_rev, "engine_kind": engine_kind, "model": model,
              "draft_model": draft_model, "hardware": to_json(hardware), "software": to_json(software),
              "state": "running", "points_total": points_total, "created_at": now, "started_at": now}
    with write(db, "the run") as tx:
        cur = tx.execute(f"INSERT INTO runs ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                         list(values.values()))
    return int(cur.lastrowid)


def get_run(db: Database, run_id: int) -> Run:
    """The run with its point counts (one reader for every caller, so the counts are never 0 by omission)."""
    return queries.get_run(db, run_id)


def update_run(db: Database, run_id: int, **values: Any) -> None:
    if isinstance(values.get("recipe"), dict):
        values["recipe"] = redact(values["recipe"])  # secrets never reach the store
    for key in ("hardware", "software", "recipe"):
        if key in values and not isinstance(values[key], str):
            values[key] = to_json(values[key])
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with write(db, "the run") as tx:
        tx.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*values.values(), run_id])


def finish_run(db: Database, run_id: int, state: str, error: str | None = None) -> None:
    update_run(db, run_id, state=state, error=error, ended_at=time.time())


# -- points --------------------------------------------------------------------------------------


def ensure_points(db: Database, run_id: int, planned: list[dict]) -> dict[str, int]:
    """Create a `pending` row for each planned point not yet in the run; {point_key: id} for all.

    `planned` items hold `point_key`, `idx` and the PARAM_COLUMNS (gpus as a list), plus
    optional `baseline`, `num_prompts`, `max_new_tokens`, `block_size`.
    """
    cols = ("run_id", "point_key", "cell_key", "idx", "state", *PARAM_COLUMNS, "baseline", "num_prompts",
            "max_new_tokens", "block_size")
    sql = f"INSERT OR IGNORE INTO points ({', '.join(f'[{c}]' for c in cols)}) VALUES ({', '.join('?' for _ in cols)})"
    with write(db, "the planned points") as tx:
        for p in planned:
            row = {**p, "run_id": run_id, "state": "pending", "gpus": to_json(list(p.get("gpus") or [])),
                   "baseline": int(bool(p.get("baseline"))), "cell_key": cell_key(p["point_key"])}
            tx.execute(sql, [row.get(c) for c in cols])
        # A resumed run may carry a re-ordered plan: keep idx in step with it.
        for p in planned:
            tx.execute("UPDATE points SET idx = ? WHERE run_id = ? AND point_key = ?", [p["idx"], run_id, p["point_key"]])
    return {row["point_key"]: row["id"] for row in fetch_rows(db, "SELECT id, point_key FROM points WHERE run_id = ?", [run_id])}


def list_points(db: Database, run_id: int) -> list[Point]:
    rows = fetch_rows(db, "SELECT * FROM points WHERE run_id = ? ORDER BY coalesce(idx, id), id", [run_id])
    return [from_row(Point, row) for row in rows]


def get_point(db: Database, point_id: int) -> Point:
    rows = fetch_rows(db, "SELECT * FROM points WHERE id = ?", [point_id])
    if not rows:
        raise NotFound(f"no point {point_id}")
    return from_row(Point, rows[0])


def mark_point(db: Database, point_id: int, state: str, *, error: str | None = None,
               started_at: float | None = None) -> None:
    if state not in POINT_STATES:
        raise StoreError(f"unknown point state {state!r}")
    values: dict[str, Any] = {"state": state, "error": error}
    if state == "running":
        values["started_at"] = started_at or time.time()
        values["ended_at"] = None
    else:
        values["ended_at"] = time.time()
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with write(db, f"point {point_id}") as tx:
        tx.execute(f"UPDATE points SET {sets} WHERE id = ?", [*values.values(), point_id])


def record_point(db: Database, point_id: int, *, state: str, metrics: dict, requests: list[dict],
                 error: str | None = None, warnings: list[str] | None = None, started_at: float | None = None,
                 ended_at: float | None = None, tau_counters: float | None = None,
                 accept_counters: dict | None = None) -> None:
    """The point's figures, its requests and its acceptance from the server's counters
    (`tau_counters`, `accept_counters`: RunAcceptance's tau and to_dict()) in one transaction;
    earlier requests of the point (from an interrupted attempt) are replaced, never added to."""
    values: dict[str, Any] = {c: metrics.get(c) for c in METRIC_COLUMNS}
    values.update(state=state, error=error, tau_hist=to_json(metrics.get("tau_hist")),
                  failures=to_json(metrics.get("failures") or None), warnings=to_json(warnings or None),
                  ended_at=ended_at or time.time(), tau_counters=tau_counters,
                  accept_counters=None if accept_counters is None else json.dumps(accept_counters))
    if started_at is not None:
        values["started_at"] = started_at
    req_cols = ("point_id", "idx", "ok", "prompt_tokens", "completion_tokens", "ttft_s", "itl_mean_s", "e2e_s",
                "verify_ct", "accept_length", "started_at", "error", "finish_reason", "detail", "accept_hist")
    req_sql = f"INSERT INTO requests ({', '.join(req_cols)}) VALUES ({', '.join('?' for _ in req_cols)})"
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with write(db, f"point {point_id}") as tx:
        tx.execute("DELETE FROM requests WHERE point_id = ?", [point_id])
        tx.execute(f"UPDATE points SET {sets} WHERE id = ?", [*values.values(), point_id])
        for r in requests:
            row = {**r, "point_id": point_id, "ok": int(bool(r.get("ok"))),
                   "accept_hist": to_json(r.get("accept_hist"))}
            tx.execute(req_sql, [row.get(c) for c in req_cols])


def reset_interrupted(db: Database, run_id: int) -> int:
    """Points left `running` by a runner that died go back to `pending`; returns how many."""
    with write(db, "the run's points") as tx:
        cur = tx.execute("UPDATE points SET state = 'pending', error = NULL WHERE run_id = ? AND state = 'running'",
                         [run_id])
    return cur.rowcount


# -- derived figures -----------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


_setting, _cell = setting_of, cell_of


def update_derived(db: Database, run_id: int, *, unstable_spread: float = UNSTABLE_CV) -> None:
    """Recompute each point's speedups (vs ar and dflash at the same setting and the same repeat,
    else the median of the baseline's repeats) and, per grid cell, the spread of its repeats: the
    coefficient of variation of output tok/s (`cv`; `unstable` when above `unstable_spread`) and
    (max - min) / median (`repeat_spread`)."""
    points = [p for p in list_points(db, run_id) if p.state == "done" and p.output_tok_s]
    base: dict[tuple, dict[int, float]] = defaultdict(dict)
    cells: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        if p.algorithm in ("ar", "dflash"):
            base[(*_setting(p), p.algorithm)][p.repeat or 0] = p.output_tok_s
        cells[_cell(p)].append(p)
    updates: dict[int, dict[str, Any]] = defaultdict(dict)
    for p in points:
        for algorithm in ("ar", "dflash"):
            by_repeat = base.get((*_setting(p), algorithm))
            if not by_repeat:
                continue
            ref = by_repeat.get(p.repeat or 0) or _median(list(by_repeat.values()))
            updates[p.id][f"speedup_vs_{algorithm}"] = p.output_tok_s / ref if ref else None
    for group in cells.values():
        rates = [p.output_tok_s for p in group]
        mid = _median(rates)
        spread = (max(rates) - min(rates)) / mid if len(rates) > 1 and mid else None
        cv = stats.summary(rates).cv
        for p in group:
            updates[p.id].update(repeat_spread=spread, cv=cv, unstable=int(cv is not None and cv > unstable_spread))
    with write(db, "speedups") as tx:
        for point_id, values in updates.items():
            sets = ", ".join(f"[{k}] = ?" for k in values)
            tx.execute(f"UPDATE points SET {sets} WHERE id = ?", [*values.values(), point_id])


def summarize(points: list[Point], *, unstable_cv: float = UNSTABLE_CV) -> list[dict]:
    """One row per grid cell (store/summary.py's `cell_rows`)."""
    return cell_rows(points, unstable_cv=unstable_cv)


def telemetry_means(db: Database, start: float, end: float, gpus: list[int] | None = None) -> tuple[float | None, float | None]:
    """Mean GPU utilisation (%) and power (W) from telemetry samples within [start, end]."""
    where, params = "at BETWEEN ? AND ?", [start, end]
    if gpus:
        where += f" AND gpu_index IN ({', '.join('?' for _ in gpus)})"
        params += list(gpus)
    row = db.execute(f"SELECT avg(util), avg(power_w) FROM telemetry WHERE {where}", params).fetchone()
    return (row[0], row[1]) if row else (None, None)
