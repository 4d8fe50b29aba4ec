"""Summarise bench/py_spy.py's samples: per file, the share of samples each thread had, and for
one thread (--thread, default the one with the most samples) the functions it spent them in,
inclusive (a function counts in every sample it is on the stack of) and at the leaf.

    python bench/py_spy_summary.py STEM-srv-process-c64-ar.txt STEM-in-process-c64-ar.txt
    python bench/py_spy_summary.py --thread engine --top 25 FILE...

The -gil.txt files hold only samples of the thread holding the GIL, so their thread shares say
who held it how often; the other files hold every thread's samples, waits included.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_THREAD = re.compile(r"^thread \((\d+)\): ?(.*)$")
_LINE = re.compile(r" \(([^()]*):\d+\)$")


def read(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames root first, samples) per line of py-spy's raw format."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        match = _THREAD.match(frames[0])
        name = frames[0]
        if match:
            name = re.sub(r" \d+$", "", match.group(2) or match.group(1))  # "engine 4" is "engine"
            frames = frames[1:]
        out.append((name, frames, int(count)))
    return out


def function(frame: str) -> str:
    """A frame without its line number: one name per function."""
    return _LINE.sub(lambda m: f" ({m.group(1)})", frame)


def summarise(path: Path, thread: str | None, top: int) -> None:
    rows = read(path)
    total = sum(n for _, _, n in rows)
    by_thread = Counter()
    for name, _, n in rows:
        by_thread[name] += n
    print(f"== {path.name}: {total} samples")
    for name, n in by_thread.most_common(8):
        print(f"  thread {name:24s} {n:7d}  {100 * n / max(total, 1):5.1f}%")
    chosen = thread if thread in by_thread else (by_thread.most_common(1)[0][0] if by_thread else None)
    if chosen is None:
        return
    mine = [(frames, n) for name, frames, n in rows if name == chosen]
    count = sum(n for _, n in mine)
    inclusive, leaf = Counter(), Counter()
    for frames, n in mine:
        for f in {function(f) for f in frames}:
            inclusive[f] += n
        if frames:
            leaf[frames[-1]] += n
    print(f"  thread {chosen}, {count} samples; inclusive:")
    for f, n in inclusive.most_common(top):
        print(f"    {100 * n / count:5.1f}%  {f}")
    print("  at the leaf:")
    for f, n in leaf.most_common(top):
        print(f"    {100 * n / count:5.1f}%  {f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--thread", default=None, help="the thread whose functions to list (default: the busiest)")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    for path in args.files:
        summarise(path, args.thread, args.top)


if __name__ == "__main__":
    main()
