"""History pane at scale: 10,000 runs, 80,000 points, 1,000,000 request rows.

Measures what a user waits for, through the console itself in a headless app at 120x40: a key
goes in as a key event, and the clock stops once the pane shows the answer and the frame that
shows it has been drawn (the query on the pane's worker thread, the table update, the render).

- open: "6" in a fresh console (the pane is built on its first visit, queries, draws);
- filter: one more character typed into the filter (it narrows), and a backspace (it widens);
- compare: "c" with two runs selected (their runs and points read, the comparison screen drawn);
- first frame: `ddtree-console --db DB` started in a pseudo-terminal until the tabs of its first
  frame arrive on the terminal (interpreter start, imports, layout, first paint), and until the
  status line shows the store; plus `make_app(...).run(headless=True)` from a fresh interpreter.

The SQL alone is timed too, to show what the rest costs. Prints medians beside the targets of
issue 9 (each History step under 200 ms, first frame under 1 s).

    .venv/bin/python bench/bench_history.py [--db /tmp/ddtree-history-bench.db] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS, POINTS_PER_RUN, REQUESTS = 10_000, 8, 1_000_000
SIZE = (120, 40)
TARGET_S = {"open": 0.2, "filter (type a key)": 0.2, "filter (backspace)": 0.2, "compare": 0.2,
            "first frame (ddtree-console, terminal)": 1.0, "first frame (make_app, headless)": 1.0}
FILTER = "kimi-k2.6-r99"
COMPARE = (4243, 9999)  # 4 GPUs vs 8 GPUs: the comparison warns


def seed(db_path: Path) -> None:
    from ddtree.store import open_db, transaction

    db = open_db(db_path)
    if db.execute("SELECT count(*) FROM runs").fetchone()[0] >= RUNS:
        db.close()
        return
    rng = random.Random(0)
    models = ["Qwen/Qwen3-8B", "Qwen/Qwen3-Coder-30B-A3B", "moonshotai/Kimi-K2.6", "meta-llama/Llama-3.1-8B"]
    gpus = [{"name": "NVIDIA H200", "memory_total": 143_771_000_000}] * 8
    t0 = time.time() - 86400 * 365
    with transaction(db):
        for r in range(1, RUNS + 1):
            model = models[r % len(models)]
            recipe = {"name": f"sweep-{r}", "engine": {"kind": "sglang", "model": model},
                      "sweep": {"budget": [8, 16, 32, 64, 128, 256], "concurrency": [1, 4]}}
            hw = {"gpus": gpus[: 4 if r % 3 else 8], "host": {"cpu_model": "AMD EPYC 9654", "cpus_logical": 384}}
            db.execute("INSERT INTO runs (id, name, recipe, engine_kind, model, hardware, state, points_total, "
                       "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       [r, f"{model.split('/')[1].lower()}-r{r}", json.dumps(recipe), "sglang", model, json.dumps(hw),
                        "succeeded", POINTS_PER_RUN, t0 + r * 600])
            for i, (alg, budget) in enumerate([("ar", None), ("dflash", None), ("ddtree", 8), ("ddtree", 16),
                                               ("ddtree", 32), ("ddtree", 64), ("ddtree", 128), ("ddtree", 256)]):
                tau = {None: 1.0 if alg == "ar" else 3.0}.get(budget, 3 + (budget or 0) ** 0.3)
                db.execute("INSERT INTO points (run_id, idx, point_key, engine_kind, algorithm, budget, tp, "
                           "concurrency, dataset, temperature, repeat, state, output_tok_s, tau_mean, tau_weighted, "
                           "e2e_p50, speedup_vs_ar) VALUES (?, ?, ?, 'sglang', ?, ?, 8, 1, 'builtin:code', 0, 0, "
                           "'done', ?, ?, ?, ?, ?)",
                           [r, i, f"{r}-{i}", alg, budget, rng.uniform(50, 400), tau, tau, rng.uniform(1, 5),
                            rng.uniform(1, 6)])
        points = db.execute("SELECT min(id), max(id) FROM points").fetchone()
        per_point = REQUESTS // (points[1] - points[0] + 1) + 1
        rows = ((pid, k, 1, 128, 0.05, 0.01, 2.0, 30, 3.5)
                for pid in range(points[0], points[1] + 1) for k in range(per_point))
        db.conn.executemany("INSERT INTO requests (point_id, idx, ok, completion_tokens, ttft_s, itl_mean_s, e2e_s, "
                            "verify_ct, accept_length) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (row for _, row in zip(range(REQUESTS), rows)))
    db.close()


# -- driving the console ---------------------------------------------------------------------------

def key(app, name: str) -> None:
    """A key as the terminal driver delivers it (no pilot pauses around it: those would be timed)."""
    from textual import events

    char = {"backspace": None}.get(name, name if len(name) == 1 else None)
    app.post_message(events.Key(name, char))


async def until(predicate, timeout: float = 30.0, what: str = "it") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"the console never showed {what}")
        await asyncio.sleep(0.002)


async def drawn(app) -> None:
    """Return once the screen has drawn what is pending."""
    await app.screen.wait_for_refresh()


def table_keys(app) -> list[str]:
    table = app.query_one("#runs")
    return [table.row_key_at(i) for i in range(table.row_count)]


async def settle(app) -> None:
    """Let the console's start-up work (first poll, hardware, imports) finish before timing."""
    await until(lambda: app.last_snapshot is not None and app.runs_signature is not None, what="the store")
    await asyncio.sleep(0.3)


class Clock:
    """Wall time and this process's CPU time (the console's threads included) of one step."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


async def time_open(db_path: Path, expected: list[str]) -> tuple[float, float]:
    from ddtree.console.app import make_app

    app = make_app(db_path, poll_s=60.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app)
        clock = Clock()
        key(app, "6")
        await until(lambda: app.current_pane == "history" and app.query("#runs")
                    and table_keys(app) == expected, what="the runs")
        await drawn(app)
        took = clock.stop()
        await pilot.press("q")
    return took


async def time_filter_and_compare(db_path: Path, repeats: int, narrow: list[str], wide: list[str],
                                  out: dict[str, list[tuple[float, float]]]) -> None:
    from ddtree.console.app import make_app
    from ddtree.console.screens.history import CompareScreen

    app = make_app(db_path, poll_s=60.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app)
        await pilot.press("6")
        await until(lambda: app.query("#runs") and table_keys(app)[:1] == [str(RUNS)], what="the runs")
        field = app.query_one("#history-filter")
        field.focus()
        await pilot.pause(0.05)  # focus selects all: type after it, not into a selection
        for _ in range(repeats):
            field.value = FILTER[:-1]
            field.cursor_position = len(field.value)  # type at the end, as after typing the rest
            await until(lambda: table_keys(app) == wide, what="the filter's first characters")
            await pilot.pause(0.05)

            clock = Clock()
            key(app, FILTER[-1])
            await until(lambda: table_keys(app) == narrow, what="the filtered runs")
            await drawn(app)
            out["filter (type a key)"].append(clock.stop())
            assert field.value == FILTER
            await pilot.pause(0.05)

            clock = Clock()
            key(app, "backspace")
            await until(lambda: table_keys(app) == wide, what="the widened runs")
            await drawn(app)
            out["filter (backspace)"].append(clock.stop())
            await pilot.pause(0.05)

        field.value = ""
        await until(lambda: table_keys(app)[:1] == [str(RUNS)], what="all runs again")
        pane = app.query_one("#history")
        app.query_one("#runs").focus()
        for _ in range(repeats):
            pane.marked = set(COMPARE)  # as two presses of space on those rows would
            await pilot.pause(0.05)
            clock = Clock()
            key(app, "c")
            await until(lambda: isinstance(app.screen, CompareScreen) and app.screen.query("#cmp-toks")
                        and app.screen.query_one("#cmp-toks").series, what="the comparison")
            await drawn(app)
            out["compare"].append(clock.stop())
            assert "hardware differs" in str(app.screen.query_one("#hw-warning").render())
            key(app, "escape")
            await until(lambda: not isinstance(app.screen, CompareScreen), what="the pane again")
            await pilot.pause(0.05)
        await pilot.press("q")


# -- first frame ------------------------------------------------------------------------------------

HEADLESS = """
import sys, time
from ddtree.console.app import make_app
app = make_app(sys.argv[1], poll_s=60.0)
def done():
    print(time.time())
    app.exit()
app.call_after_refresh(done)
app.run(headless=True, size=(100, 30))
"""


def first_frame_headless(db_path: Path) -> float:
    start = time.time()
    out = subprocess.run([sys.executable, "-c", HEADLESS, str(db_path)], capture_output=True, text=True, timeout=60)
    return float(out.stdout.strip().splitlines()[-1]) - start


def first_frame_terminal(db_path: Path) -> tuple[float, float]:
    """(seconds to the first frame, seconds until the store's figures are on screen)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ddtree-console")
    main, child = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(SIZE[0]), LINES=str(SIZE[1]))
    start = time.monotonic()
    proc = subprocess.Popen([exe, "--db", str(db_path)], stdin=child, stdout=child, stderr=child, env=env,
                            start_new_session=True)
    os.close(child)
    screen, frame, data = b"", None, None
    try:
        while data is None:
            if time.monotonic() - start > 60:
                raise AssertionError(f"no frame from the console: {screen[-2000:]!r}")
            ready, _, _ = select.select([main], [], [], 0.05)
            if ready:
                screen += os.read(main, 1 << 16)
                now = time.monotonic() - start
                if frame is None and b"Overview" in screen:
                    frame = now
                if frame is not None and b"updated" in screen:
                    data = now
        os.write(main, b"q")
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    return frame, data


# -- main -------------------------------------------------------------------------------------------

def sql_only(db_path: Path, repeats: int) -> dict[str, list[float]]:
    from ddtree.console.screens.history import load_runs
    from ddtree.store import open_db, sweeps

    out: dict[str, list[float]] = {"open": [], "filter (type a key)": [], "filter (backspace)": [], "compare": []}
    db = open_db(db_path)
    for _ in range(repeats):
        for name, text in (("open", ""), ("filter (type a key)", FILTER), ("filter (backspace)", FILTER[:-1])):
            t = time.perf_counter()
            load_runs(db, text)
            out[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        for run_id in COMPARE:
            sweeps.get_run(db, run_id)
            sweeps.list_points(db, run_id)
        out["compare"].append(time.perf_counter() - t)
    db.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("/tmp/ddtree-history-bench.db"))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    t = time.perf_counter()
    seed(args.db)
    from ddtree.console.screens.history import load_runs
    from ddtree.store import open_db

    db = open_db(args.db)
    counts = [db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("runs", "points", "requests")]
    expected = {text: [str(r["id"]) for r in load_runs(db, text)[0]] for text in ("", FILTER, FILTER[:-1])}
    db.close()
    print(f"store {args.db}: {counts[0]} runs, {counts[1]} points, {counts[2]} requests "
          f"(ready in {time.perf_counter() - t:.1f} s); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"filter {FILTER!r}: {len(expected[FILTER])} rows; {FILTER[:-1]!r}: {len(expected[FILTER[:-1]])} rows")

    results: dict[str, list[tuple[float, float | None]]] = {name: [] for name in TARGET_S}
    results["store on screen (ddtree-console, terminal)"] = []
    for _ in range(args.repeats):
        results["open"].append(asyncio.run(time_open(args.db, expected[""])))
    asyncio.run(time_filter_and_compare(args.db, args.repeats, expected[FILTER], expected[FILTER[:-1]], results))
    for _ in range(max(3, args.repeats // 2)):
        frame, data = first_frame_terminal(args.db)
        results["first frame (ddtree-console, terminal)"].append((frame, None))
        results["store on screen (ddtree-console, terminal)"].append((data, None))
        results["first frame (make_app, headless)"].append((first_frame_headless(args.db), None))
    sql = sql_only(args.db, args.repeats)

    print(f"\n{'wall clock, ms':<42}{'median':>8}{'min':>8}{'max':>8}{'target':>8}{'':6}{'CPU':>7}{'SQL':>7}")
    for name, values in results.items():
        walls = [w for w, _ in values]
        cpus = [c for _, c in values if c is not None]
        med = statistics.median(walls)
        target = TARGET_S.get(name)
        verdict = "" if target is None else ("ok" if med < target else "OVER")
        cols = [f"{med * 1000:8.1f}", f"{min(walls) * 1000:8.1f}", f"{max(walls) * 1000:8.1f}",
                f"{target * 1000:8.0f}" if target else " " * 8, f"  {verdict:<4}",
                f"{statistics.median(cpus) * 1000:7.1f}" if cpus else " " * 7,
                f"{statistics.median(sql[name]) * 1000:7.1f}" if name in sql else ""]
        print(f"{name:<42}" + "".join(cols))
    print(f"(medians of {args.repeats} per History step; CPU: the console process's CPU time in the step, all its "
          f"threads; SQL: the step's queries alone; load average after: {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
