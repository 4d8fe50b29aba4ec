"""Plain-text formatting shared by the CLI tables and the console (no Textual here)."""

from __future__ import annotations

import re
import time

# What a terminal would act on instead of showing: C0 controls (ESC starts CSI/OSC sequences), DEL,
# C1 controls (U+009B is a one-character CSI), the line and paragraph separators, and the bidi
# embeddings, overrides and isolates (U+202E reverses what follows: "Trojan Source").
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str | None) -> str:
    """`text` safe to print into a terminal: control and bidi characters shown as escapes
    (ESC -> \\x1b, U+202E -> \\u202e), everything else unchanged. For every text the store holds
    (run and recipe names, errors, messages) on its way to the screen."""
    if not text:
        return "" if text is None else text
    return _UNSAFE.sub(_escape, str(text))


def duration(seconds: float | None) -> str:
    """12s, 3m04s, 2h05m, 3d04h; '-' for None."""
    if seconds is None:
        return "-"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


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


def one_line(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    text = printable(" ".join(str(text).split()))
    return text if len(text) <= width else text[: width - 1] + "…"
