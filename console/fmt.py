"""Plain-text formatting shared by the CLI tables and the console (no Textual here)."""

from __future__ import annotations

import time

# Re-exported: the console has always called these fmt.duration, fmt.one_line, fmt.printable.
from ddtree.engine.units import duration, one_line, printable  # noqa: F401


def ago(at: float | None, now: float | None = None) -> str:
    if at is None:
        return "-"
    return duration((now if now is not None else time.time()) - at) + " ago"


def stamp(at: float | None, *, seconds: bool = False) -> str:
    pattern = "%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M"
    return "-" if at is None else time.strftime(pattern, time.localtime(at))


def progress(done: float | None, total: float | None) -> str:
    if total and done is not None and total > 0:
        return f"{100.0 * min(done, total) / total:.0f}%"
    if done is not None:
        return f"{done:g}"
    return "-"


def points(done: int | None, total: int | None) -> str:
    """A run's points cell, '9/14' (done of planned) or '9' when the plan size is unknown: one cell
    for the History table, the compare view and `ddtree-console runs`, from the store's count
    (Run.points_done / runs_page's points_done), so they never disagree."""
    done = done or 0
    return f"{done}/{total}" if total else str(done)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [headers, *rows]:
        cells = [cell.ljust(widths[i]) if i < len(row) - 1 else cell for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
