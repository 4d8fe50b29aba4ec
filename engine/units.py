"""Plain-text units every layer prints: byte sizes, durations, counts in words, safe one-line text.

It lives in engine/ because that is the lowest layer the console, the jobs and the engine all
import (the store is a sibling and prints none of these). No torch and no Textual here.
"""

from __future__ import annotations

import re

# What a terminal would act on instead of showing: C0 controls (ESC starts CSI/OSC sequences), DEL,
# C1 controls (U+009B is a one-character CSI), the line and paragraph separators, and the bidi
# embeddings, overrides and isolates (U+202E reverses what follows: "Trojan Source").
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def fmt_bytes(n: float | None) -> str:
    """Decimal units, as disks and the Hub count them: 512 B, 1.5 kB, 3.2 GB; '-' for None."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # not reached: TB takes everything left


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


def plural(n: int, word: str, words: str | None = None) -> str:
    """`n` and the word in the number it needs: plural(1, "run") -> "1 run", plural(3, "run") -> "3 runs";
    `words` for a plural that is not word + "s" (plural(2, "point in progress", "points in progress"))."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


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


def one_line(text: object, width: int | None = 60) -> str:
    """`text` on one line (third-party errors, the hub's for one, carry newlines), safe to print,
    cut to `width` characters with an ellipsis; width=None keeps it whole."""
    if not text:
        return ""
    flat = printable(" ".join(str(text).split()))
    return flat if width is None or len(flat) <= width else flat[: width - 1] + "…"
