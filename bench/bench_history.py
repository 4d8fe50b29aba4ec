"""History pane at scale: 10,000 runs, 80,000 points, 1,000,000 request rows.

Measures, through the console's own query and render path in a headless app (the query on the
pane's worker, the table update, one refresh): opening the pane, filtering, and comparing two
runs; plus the console's time to first frame in a fresh interpreter. Prints medians (target: each
under 200 ms; first frame under 1 s).

    .venv/bin/python bench/bench_history.py [--db /tmp/history-bench.db] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS, POINTS_PER_RUN, REQUESTS = 10_000, 8, 1_000_000


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


async def measure(db_path: Path, repeats: int) -> dict[str, list[float]]:
    from ddtree.console.app import make_app
    from ddtree.console.screens.history import CompareScreen, load_runs
    from ddtree.store import open_db, sweeps

    out: dict[str, list[float]] = {"open": [], "filter": [], "compare": []}
    app = make_app(db_path, poll_s=60.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("6")
        await pilot.pause(0.5)
        pane = app.query_one("#history")
        db = open_db(db_path)
        for _ in range(repeats):
            t = time.perf_counter()
            rows, total = load_runs(db, "", 0)
            pane.show(rows, total)
            await pilot.pause()
            out["open"].append(time.perf_counter() - t)
            assert total == RUNS and len(rows) == 200

            t = time.perf_counter()
            rows, total = load_runs(db, "kimi-k2.6-r99", 0)
            pane.show(rows, total)
            await pilot.pause()
            out["filter"].append(time.perf_counter() - t)
            assert rows, "the filter matched nothing"

            t = time.perf_counter()
            a, b = 4243, 9999
            runs = [sweeps.get_run(db, a), sweeps.get_run(db, b)]
            points = {a: sweeps.list_points(db, a), b: sweeps.list_points(db, b)}
            screen = CompareScreen(runs, points)
            await app.push_screen(screen)
            await pilot.pause()
            out["compare"].append(time.perf_counter() - t)
            assert screen.query_one("#hw-warning")  # run 4243 has 4 GPUs, 9999 has 8
            screen.dismiss(None)
            await pilot.pause()
        db.close()
        await pilot.press("q")
    return out


FIRST_FRAME = """
import sys, time
t0 = time.perf_counter()
from ddtree.console.app import make_app
app = make_app(sys.argv[1], poll_s=60.0)
def done():
    print(time.perf_counter() - t0)
    app.exit()
app.call_after_refresh(done)
app.run(headless=True, size=(100, 30))
"""


def first_frame(db_path: Path, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", FIRST_FRAME, str(db_path)], capture_output=True, text=True,
                             timeout=60)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("/tmp/ddtree-history-bench.db"))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    t = time.perf_counter()
    seed(args.db)
    from ddtree.store import open_db

    db = open_db(args.db)
    counts = [db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("runs", "points", "requests")]
    db.close()
    print(f"store {args.db}: {counts[0]} runs, {counts[1]} points, {counts[2]} requests "
          f"(ready in {time.perf_counter() - t:.1f} s)")
    results = asyncio.run(measure(args.db, args.repeats))
    results["first frame (fresh interpreter)"] = first_frame(args.db, max(3, args.repeats // 2))
    for name, values in results.items():
        med = statistics.median(values) * 1000
        print(f"{name:<32} median {med:7.1f} ms  (min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f}, "
              f"n={len(values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
