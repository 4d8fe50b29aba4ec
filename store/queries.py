"""Reads and small writes shared by the CLI, the console and the runners."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlite_utils import Database

from ddtree.store.db import transaction
from ddtree.store.errors import NotFound
from ddtree.store.records import Job, JobEvent, Process, Run, from_row
from ddtree.store.summary import CELL_FIELDS


def to_json(value: Any) -> str | None:
    """JSON text for a JSON column (None stays NULL)."""
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def insert_row(db: Database, table: str, values: dict[str, Any]) -> int:
    """Insert one row in a short transaction and return its id."""
    cols = list(values)
    sql = f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in cols)}) VALUES ({', '.join('?' for _ in cols)})"
    with transaction(db):
        cur = db.execute(sql, [values[c] for c in cols])
    return int(cur.lastrowid)


def update_row(db: Database, table: str, row_id: int, values: dict[str, Any]) -> None:
    """Update columns of one row in a short transaction (no error if the row is gone)."""
    if not values:
        return
    sets = ", ".join(f"[{c}] = ?" for c in values)
    with transaction(db):
        db.execute(f"UPDATE [{table}] SET {sets} WHERE id = ?", [*values.values(), row_id])


#: engines.state values of a server that may still be up; any other state is final.
OPEN_ENGINE_STATES = ("starting", "running")


def close_engines(db: Database, job_id: int, state: str, error: str) -> int:
    """Close the engine rows of `job_id` still `starting`/`running` (their runner is gone, so no one
    else will): `state` (lost, stopped), `error`, ended_at now. Returns how many were closed."""
    with transaction(db):
        cur = db.execute(
            "UPDATE engines SET state = ?, error = coalesce(error, ?), ended_at = ? "
            f"WHERE job_id = ? AND state IN ({', '.join('?' for _ in OPEN_ENGINE_STATES)})",
            [state, error, now(), job_id, *OPEN_ENGINE_STATES],
        )
    return cur.rowcount


def recent_engines(db: Database, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` engines rows, newest first."""
    return fetch_rows(db, "SELECT * FROM engines ORDER BY id DESC LIMIT ?", [int(limit)])


def get_job(db: Database, job_id: int) -> Job:
    rows = fetch_rows(db, "SELECT * FROM jobs WHERE id = ?", [job_id])
    if not rows:
        raise NotFound(f"no job with id {job_id}", "list jobs with `ddtree-console jobs`")
    return from_row(Job, rows[0])


def list_jobs(db: Database, *, states: set[str] | None = None, limit: int | None = None) -> list[Job]:
    """Jobs, newest first."""
    sql = "SELECT * FROM jobs"
    params: list[Any] = []
    if states:
        sql += f" WHERE state IN ({', '.join('?' for _ in states)})"
        params.extend(sorted(states))
    sql += " ORDER BY id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(int(limit))
    return [from_row(Job, row) for row in fetch_rows(db, sql, params)]


def job_events(db: Database, job_id: int) -> list[JobEvent]:
    return [
        from_row(JobEvent, row)
        for row in fetch_rows(db, "SELECT * FROM job_events WHERE job_id = ? ORDER BY id", [job_id])
    ]


def job_processes(db: Database, job_id: int, *, running_only: bool = False) -> list[Process]:
    sql = "SELECT * FROM processes WHERE job_id = ?"
    if running_only:
        sql += " AND ended_at IS NULL"
    return [from_row(Process, row) for row in fetch_rows(db, sql + " ORDER BY id", [job_id])]


def get_run(db: Database, run_id: int) -> Run:
    runs = _runs(db, "WHERE r.id = ?", [run_id])
    if not runs:
        raise NotFound(f"no run with id {run_id}", "list runs with `ddtree-console runs`")
    return runs[0]


def list_runs(db: Database, *, text: str | None = None, limit: int | None = None,
              unnamed_model: bool = False) -> list[Run]:
    """Runs, newest first; `text` keeps those whose name, models, engine, state or recipe contain
    it (case-insensitive), and with `unnamed_model` those recorded without a model."""
    where, params = _text_filter(text or "", unnamed_model=unnamed_model)
    suffix = " LIMIT ?" if limit is not None else ""
    if limit is not None:
        params.append(int(limit))
    return _runs(db, where, params, suffix)


#: Orders of `runs_page`, by name.
RUN_ORDERS = {
    "newest": "r.id DESC",
    "oldest": "r.id ASC",
    "name": "lower(coalesce(r.name, '')), r.id DESC",
    "model": "lower(coalesce(r.model, '')), r.id DESC",
    "best tok/s": "best DESC NULLS LAST, r.id DESC",
}
_TEXT_COLUMNS = ("r.name", "r.model", "r.draft_model", "r.engine_kind", "r.state", "r.recipe")


def _text_filter(text: str, *, unnamed_model: bool = False) -> tuple[str, list]:
    """The WHERE clause (and its parameters) keeping runs `r` whose name, models, engine, state or
    recipe hold `text` as a substring, ASCII case folded; '' and [] for no text. The text is
    literal, not a LIKE pattern: `runs --filter demo_x` must not match "demo-x". With
    `unnamed_model`, runs recorded without a model match too (the caller knows what they are shown
    as: the demo pair)."""
    if not text.strip():
        return "", []
    # LIKE folds ASCII case as lower() does, and a NULL column just does not match, so the
    # columns go to LIKE bare (half the work per row).
    like = "%" + text.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    terms = [f"{c} LIKE ? ESCAPE '\\'" for c in _TEXT_COLUMNS] + ["coalesce(r.model, '') = ''"] * unnamed_model
    return "WHERE " + " OR ".join(terms), [like] * len(_TEXT_COLUMNS)


def _points_in(state: str) -> str:
    """The SQL count of run `r`'s points in `state` ('done', 'failed'): the one definition of a
    run's points done, which every reader of run summaries (the History page, `get_run`,
    `list_runs`, and through them the compare view and `ddtree-console runs`) selects."""
    if state not in ("done", "failed"):
        raise ValueError(f"no point count for state {state!r}")
    return f"(SELECT count(*) FROM points p WHERE p.run_id = r.id AND p.state = '{state}')"


#: The SQL of run `r`'s best output tok/s: the highest median over a grid cell's done repeats (a
#: cell: store.summary.CELL_FIELDS, as cell_of groups them), the figure `runs`, the exports'
#: "out tok/s (median)" column and the recommendations quote. The highest single repeat, which it
#: was, is a figure that appears in none of them and favours the noisiest cell.
_CELL = ", ".join(CELL_FIELDS)
_BEST_CELL_MEDIAN = (
    f"(SELECT max(med) FROM (SELECT avg(v) AS med FROM (SELECT output_tok_s AS v, {_CELL}, "
    f"row_number() OVER (PARTITION BY {_CELL} ORDER BY output_tok_s) AS i, "
    f"count(*) OVER (PARTITION BY {_CELL}) AS n "
    "FROM points p WHERE p.run_id = r.id AND p.state = 'done' AND p.output_tok_s IS NOT NULL) "
    f"WHERE i BETWEEN (n + 1) / 2 AND n / 2 + 1 GROUP BY {_CELL}))"
)


def runs_page(db: Database, text: str = "", *, order: str = "newest", limit: int = 200,
              unnamed_model: bool = False) -> tuple[list[dict], int]:
    """A page of run summaries for a table (id, name, engine_kind, model, state, points_total,
    created_at, points_done, best output tok/s), matching `text` as a substring (ASCII case
    folded) of name, models, engine, state or recipe (and, with `unnamed_model`, runs recorded
    without a model); and how many runs match in all."""
    where, params = _text_filter(text, unnamed_model=unnamed_model)
    sql = ("SELECT r.id, r.name, r.engine_kind, r.model, r.state, r.points_total, r.created_at, "
           f"{_points_in('done')} AS points_done, "
           f"{_BEST_CELL_MEDIAN} AS best "
           f"FROM runs r {where} ORDER BY {RUN_ORDERS[order]} LIMIT ?")
    rows = fetch_rows(db, sql, [*params, int(limit)])
    if len(rows) < limit:
        return rows, len(rows)  # all of them: no second scan for the count
    return rows, db.execute(f"SELECT count(*) FROM runs r {where}", params).fetchone()[0]


def runs_signature(db: Database) -> tuple[tuple, tuple]:
    """A value that changes whenever a run or a point is added, ends or changes state: cheaper
    than reading the History pane's page to see whether it changed."""
    runs = db.execute("SELECT count(*), max(id), max(coalesce(ended_at, 0)), max(coalesce(state, '')) "
                      "FROM runs").fetchone()
    points = db.execute("SELECT max(id), max(coalesce(ended_at, 0)) FROM points").fetchone()
    return tuple(runs), tuple(points)


def _runs(db: Database, where: str, params: list[Any], suffix: str = "") -> list[Run]:
    sql = (
        "SELECT r.*, "
        f"{_points_in('done')} AS points_done, "
        f"{_points_in('failed')} AS points_failed "
        f"FROM runs r {where} ORDER BY r.id DESC{suffix}"
    )
    return [from_row(Run, row) for row in fetch_rows(db, sql, params)]


def now() -> float:
    return time.time()


def fetch_rows(db: Database, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    """Rows of a query as dicts keyed by column name."""
    cur = db.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]

