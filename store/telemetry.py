"""The `telemetry` table: GPU samples, one row per GPU per tick, kept for a day.

`TelemetryWriter(db, labels=...)` is the sink the engine's sampler hands its samples to
(`Sampler.start(stop, sink=writer)`): the sampler knows no schema, this module knows no NVML.
A sample is anything with `at` (unix time) and `gpus`, each GPU with `index`, `util`, `mem_used`,
`mem_total`, `power_w` and `temperature_c` (ddtree.engine.machine.sampler.TelemetrySample; the
store does not import the engine, its sibling).
"""

from __future__ import annotations

from typing import Any

from sqlite_utils import Database

from ddtree.store.errors import StoreError

#: How long rows are kept, and how often the old ones are deleted.
RETENTION_S = 24 * 3600.0
PRUNE_EVERY_S = 60.0


class TelemetryWriter:
    """Writes each sample in one short transaction and deletes rows past the retention about once
    a minute. Only the columns the table has are written, so a scratch table with fewer (a
    benchmark's) works too. Use it from one thread: the sampler's."""

    def __init__(self, db: Database, *, labels: dict[str, Any] | None = None,
                 retention_s: float = RETENTION_S) -> None:
        if not retention_s > 0:
            raise StoreError(f"telemetry retention must be positive, got {retention_s} s")
        self.db, self.labels, self.retention_s = db, dict(labels or {}), float(retention_s)
        self._columns: set[str] | None = None
        self._last_prune = 0.0

    def __call__(self, sample: Any) -> int:
        """Insert one row per GPU of `sample`; returns how many."""
        table = self.db["telemetry"]
        if self._columns is None:
            self._columns = set(table.columns_dict) if table.exists() else set()
        if not self._columns:
            return 0
        rows = []
        for g in sample.gpus:
            row = {"at": sample.at, "gpu_index": g.index, "util": g.util, "mem_used": g.mem_used,
                   "mem_total": g.mem_total, "power_w": g.power_w, "temp_c": g.temperature_c, **self.labels}
            rows.append({k: v for k, v in row.items() if k in self._columns})
        with self.db.conn:
            if rows:
                table.insert_all(rows)
            if sample.at - self._last_prune >= PRUNE_EVERY_S:
                self._last_prune = sample.at
                self.db.execute("DELETE FROM telemetry WHERE at < ?", [sample.at - self.retention_s])
        return len(rows)
