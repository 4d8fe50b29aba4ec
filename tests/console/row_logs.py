"""A log file for a seeded row, for the console tests that open a job's or an engine's log."""

from __future__ import annotations

from pathlib import Path

from ddtree.store import open_db
from ddtree.store.queries import update_row


def log_of(db_path, table: str, row_id: int, path: Path, text: str) -> Path:
    """Write `text` to `path` and make it the log of row `row_id` of `table` (jobs, engines)."""
    path.write_text(text)
    with open_db(db_path) as db:
        update_row(db, table, row_id, {"log_path": str(path)})
    return path
