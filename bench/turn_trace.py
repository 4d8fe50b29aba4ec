"""Which scheduler turns make a server's inter-token and first-token tails.

Reads the builtin server's --trace-turns file (one JSON line per turn, scheduler.py) and, with a
bench_server.py --grid JSON, splits it by each server cell's turn_range:

    python bench/bench_server.py --grid ... --trace-turns /tmp/turns --out /tmp/grid.json
    python bench/turn_trace.py /tmp/turns-process.jsonl --grid /tmp/grid.json

Per cell (or for the whole file without --grid) it prints the turns by how they stepped their
requests (alone, prefill, round, prefill+round, together: new and running requests in one
engine call, where new ones ride in the round or, as a burst, prefill first),
each kind's count and p50/p99 seconds, and the stream gaps: a turn's time once for every request
that was running through it, the engine side of the client's ITL. The tail line says which
kinds the slowest 1% of those gaps came from; the first line, how long the engine sat idle
between turns (waiting for requests: what the closed loop through HTTP costs).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

from ddtree.engine.serving.bench import percentile  # the sweep client's, as its ITL p99 is read


def load(path: Path) -> list[dict]:
    turns = []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        try:
            turns.append(json.loads(line))
        except ValueError:
            raise SystemExit(f"{path}:{n}: not a JSON line (is this a --trace-turns file?)") from None
    return turns


def kind(turn: dict) -> str:
    """How the turn stepped its requests; for new ones beside a round, whether they rode in it
    (their shape) or prefilled as a burst."""
    how, note = turn["how"] or "idle", turn.get("note") or ""
    return f"{how} ({note})" if note else how


def _span(turns: list[dict]) -> float:
    return turns[-1]["t"] + turns[-1]["s"] - turns[0]["t"] if turns else 0.0


def summary(turns: list[dict]) -> dict:
    """Turns by kind, and the running streams' gaps with the kinds of their slowest 1%."""
    kinds: dict[str, list[float]] = {}
    parts: dict[str, dict[str, list[float]]] = {}  # kind -> part -> seconds (turns that have them)
    waits: dict[str, dict[str, list[float]]] = {}  # kind -> "push" / "gpu" -> seconds (turn_waits)
    for t in turns:
        kinds.setdefault(kind(t), []).append(t["s"])
        for name, seconds in (t.get("parts") or {}).items():
            parts.setdefault(kind(t), {}).setdefault(name, []).append(seconds)
        if t.get("waits"):
            for name in ("push", "gpu"):
                waits.setdefault(kind(t), {}).setdefault(name, []).append(t["waits"].get(name, 0.0))
    gaps = sorted(((t["s"], kind(t)) for t in turns for _ in range(t["running"])), reverse=True)
    tail = gaps[:max(1, len(gaps) // 100)] if gaps else []
    return {
        "turns": len(turns),
        "kinds": {how: {"count": len(s), "p50_ms": 1000 * percentile(s, 50), "p99_ms": 1000 * percentile(s, 99),
                        # the engine's parts of such a turn (fast/batch.py's turn_parts), p50 ms each
                        **({"parts_p50_ms": {name: 1000 * percentile(v, 50) for name, v in parts[how].items()}}
                           if how in parts else {}),
                        # the writes in the GPU's wait, and the wait left after them (turn_waits)
                        **({"waits_p50_ms": {name: 1000 * percentile(v, 50) for name, v in waits[how].items()},
                            "gpu_wait_under_0.1ms": sum(1 for v in waits[how]["gpu"] if v < 1e-4)}
                           if how in waits else {})}
                  for how, s in sorted(kinds.items(), key=lambda kv: -len(kv[1]))},
        "gaps": len(gaps),
        "gap_p50_ms": 1000 * percentile([g for g, _ in gaps], 50) if gaps else None,
        "gap_p99_ms": 1000 * percentile([g for g, _ in gaps], 99) if gaps else None,
        "tail_kinds": dict(Counter(how for _, how in tail).most_common()),
        # The engine's idle share of the cell: time between turns, waiting for requests.
        "idle_pct": 100 * (1 - sum(t["s"] for t in turns) / span) if (span := _span(turns)) > 0 else None,
        # Its longest such wait: one stall (a client's pause) against many short ones.
        "idle_max_ms": 1000 * max((b["t"] - a["t"] - a["s"] for a, b in zip(turns, turns[1:])), default=0.0),
        "first_tokens": sum(t["firsts"] for t in turns),
        "tokens": sum(t["tokens"] for t in turns),
        # Turns that held joiners back under the server's --max-prefill-tokens (traces from
        # before that flag have no "held").
        "held_turns": sum(1 for t in turns if t.get("held")),
        # Turns a garbage collection ran in, and its time (traces from before "gc" have none).
        "gc_turns": sum(1 for t in turns if t.get("gc")),
        "gc_ms": 1000 * sum(t.get("gc", 0) for t in turns),
        "gc_max_ms": 1000 * max((t.get("gc", 0) for t in turns), default=0),
    }


def show(label: str, s: dict) -> None:
    idle = (f", the engine idle {s['idle_pct']:.1f}% of the time (at most {s['idle_max_ms']:.1f} ms at once)"
            if s["idle_pct"] is not None else "")
    held = f", {s['held_turns']} holding joiners back (--max-prefill-tokens)" if s["held_turns"] else ""
    print(f"{label}: {s['turns']} turns, {s['tokens']} tokens, {s['first_tokens']} first tokens{idle}{held}")
    for how, k in s["kinds"].items():
        print(f"  {how:14s} {k['count']:6d} turns  p50 {k['p50_ms']:7.2f} ms  p99 {k['p99_ms']:7.2f} ms")
        if "parts_p50_ms" in k:
            print("  " + " " * 14 + " parts p50: " + ", ".join(f"{name} {ms:.2f}" for name, ms in k["parts_p50_ms"].items()) + " ms")
        if "waits_p50_ms" in k:
            w = k["waits_p50_ms"]
            print("  " + " " * 14 + f" writes in the GPU's wait p50 {w['push']:.2f} ms, the wait after them p50 "
                  f"{w['gpu']:.2f} ms, under 0.1 ms in {k['gpu_wait_under_0.1ms']} turns")
    if s["gc_turns"]:
        print(f"  garbage collections in {s['gc_turns']} turns: {s['gc_ms']:.1f} ms in all, the longest "
              f"{s['gc_max_ms']:.1f} ms")
    if s["gaps"]:
        print(f"  stream gaps    {s['gaps']:6d}        p50 {s['gap_p50_ms']:7.2f} ms  p99 {s['gap_p99_ms']:7.2f} ms;"
              f" slowest 1% from {s['tail_kinds']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a --trace-turns file (or it gzipped, .gz)")
    p.add_argument("--grid", type=Path, help="the bench_server.py --grid JSON whose server wrote it: split by cell")
    p.add_argument("--loop", default="process", help="which engine loop's cells (default: process)")
    args = p.parse_args(argv)
    for path in [args.trace] + ([args.grid] if args.grid else []):
        if not path.is_file():
            p.error(f"no such file: {path}")
    turns = load(args.trace)
    if args.grid is None:
        show(str(args.trace), summary(turns))
        return 0
    try:
        cells = json.loads(args.grid.read_text())["grid"]["servers"][args.loop]
    except (ValueError, KeyError, TypeError):
        p.error(f"{args.grid}: no server cells for --loop {args.loop}")
    out = {}
    for cell in cells:
        if "turn_range" not in cell:
            continue
        first, last = cell["turn_range"]
        label = f"c={cell['concurrency']} {cell['algorithm']}"
        out[label] = summary([t for t in turns if first < t["turn"] <= last])
        show(label, out[label])
    if not out:
        print("no cell has a turn_range (a grid from before --trace-turns?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
