"""Small text helpers for tables: in-place row sync, bars, sparklines, byte sizes."""

from __future__ import annotations

from rich.text import Text

from ddtree.console.widgets.rowtable import RowTable
from ddtree.engine.units import fmt_bytes  # noqa: F401 - the panes import it from here with bar and fmt_rate

_SPARK = "▁▂▃▄▅▆▇█"


def sync_table(table: RowTable, rows: list[tuple[str, tuple]]) -> None:
    """Make `table` show `rows` (key, cells), redrawing only rows that changed and keeping the
    cursor on the same key, so a poll does not redraw the whole table."""
    table.set_rows(rows)


def bar(fraction: float | None, width: int = 12) -> Text:
    """A progress bar with eighth-cell resolution, then the percentage."""
    if fraction is None:
        return Text("-".ljust(width + 5), style="dim")
    fraction = max(0.0, min(1.0, fraction))
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    body = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
    style = "green" if fraction >= 1.0 else "dodger_blue2"
    return Text.assemble((body.ljust(width), style), (f" {fraction * 100:3.0f}%", ""))


def sparkline(values: list[float | None], lo: float = 0.0, hi: float | None = None) -> str:
    """One character per value; None shows as a space."""
    known = [v for v in values if v is not None]
    if not known:
        return " " * len(values)
    top = hi if hi is not None else max(known)
    span = (top - lo) or 1.0
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        else:
            out.append(_SPARK[max(0, min(7, int((v - lo) / span * 7.999)))])
    return "".join(out)


def fmt_rate(bps: float | None) -> str:
    return "-" if not bps else fmt_bytes(bps) + "/s"


def fmt_num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
