"""Words that follow a count: "1 run", "2 runs", "1 GPU", "0 engines"."""

from __future__ import annotations


def plural(n: int, word: str, words: str | None = None) -> str:
    """`n` and the word in the number it needs: plural(1, "run") -> "1 run", plural(3, "run") -> "3 runs";
    `words` for a plural that is not word + "s" (plural(2, "point in progress", "points in progress"))."""
    return f"{n} {word if n == 1 else (words or word + 's')}"
