"""What competed with each point (issue 16): the writes the sweep makes and the reads the pane and
the exports make. The reading itself comes from engine/machine/contention.py as a plain dict; the store
keeps it as JSON on the point row (`points.contention`) next to a 0/1 flag (`points.contended`)."""

from __future__ import annotations

from typing import Any

from sqlite_utils import Database

from ddtree.store.queries import to_json
from ddtree.store.sweeps import write

#: The export columns, in order: (column name, how to take it from a stored reading).
EXPORT_COLUMNS = ("contended", "busy_reasons", "host_load1", "host_cpu_percent", "others_cpu_cores",
                  "gpu_other_processes", "gpu_clock_events", "gpu_temperature_c")


def record_contention(db: Database, point_id: int, reading: dict, reasons: list[str]) -> None:
    """Store a point's reading and whether it was contended (any reason)."""
    doc = {**reading, "reasons": list(reasons)}
    with write(db, f"point {point_id} contention") as tx:
        tx.execute("UPDATE points SET contention = ?, contended = ? WHERE id = ?",
                   [to_json(doc), int(bool(reasons)), point_id])


def export_fields(point: Any) -> dict[str, Any]:
    """The contention columns of one point for csv/json/md (None where it was not measured)."""
    doc = getattr(point, "contention", None) or {}
    gpus = doc.get("gpus") or []
    events = sorted({e for g in gpus for e in (g.get("clock_events") or ())})
    temps = [g["temperature_c"] for g in gpus if g.get("temperature_c") is not None]
    contended = getattr(point, "contended", None)
    return {
        "contended": None if contended is None else bool(contended),
        "busy_reasons": "; ".join(doc.get("reasons") or ()) or None,
        "host_load1": doc.get("load1"),
        "host_cpu_percent": doc.get("cpu_percent"),
        "others_cpu_cores": doc.get("others_cores"),
        "gpu_other_processes": sum(len(g.get("other_pids") or ()) for g in gpus) if gpus else None,
        "gpu_clock_events": ",".join(events) if gpus and events else None,
        "gpu_temperature_c": max(temps) if temps else None,
    }


def contended_points(points: list) -> list:
    """The points flagged contended, in run order."""
    return [p for p in points if getattr(p, "contended", None)]


def run_busy_note(points: list) -> str | None:
    """One short note for a run's header: how many points ran on a busy box and the worst load.
    None when no point was contended (or none was measured)."""
    busy = contended_points(points)
    if not busy:
        return None
    loads = [p.contention.get("load1") for p in busy if isinstance(p.contention, dict)
             and p.contention.get("load1") is not None]
    cores = [p.contention.get("others_cores") for p in busy if isinstance(p.contention, dict)
             and p.contention.get("others_cores") is not None]
    parts = [f"{len(busy)}/{len(points)} " + ("point" if len(points) == 1 else "points")]
    if loads:
        parts.append(f"load {max(loads):.1f}")
    if cores:
        parts.append(f"others {max(cores):.2f} cores")
    return "busy box: " + ", ".join(parts)
