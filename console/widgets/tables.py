"""Small text helpers for tables: in-place row sync, bars, sparklines, byte sizes."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

_SPARK = "▁▂▃▄▅▆▇█"


def sync_table(table: DataTable, rows: list[tuple[str, tuple]]) -> None:
    """Make `table` show `rows` (key, cells), changing only cells that differ and keeping the
    cursor on the same key, so a poll does not redraw the whole table."""
    keys = [key for key, _ in rows]
    current = [row_key.value for row_key in table.rows]
    if keys == current:
        for key, cells in rows:
            for column_key, value in zip(table.columns, cells):
                if table.get_cell(key, column_key) != value:
                    table.update_cell(key, column_key, value)
        return
    selected = None
    if table.row_count and table.cursor_row is not None and 0 <= table.cursor_row < table.row_count:
        selected = current[table.cursor_row]
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    if selected in keys:
        table.move_cursor(row=keys.index(selected))


def selected_key(table: DataTable) -> str | None:
    if not table.row_count or table.cursor_row is None or not 0 <= table.cursor_row < table.row_count:
        return None
    return table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value


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


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_rate(bps: float | None) -> str:
    return "-" if not bps else fmt_bytes(bps) + "/s"


def fmt_num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
