"""CPU cost of the telemetry sampler at a set rate (the issue's bar: under 1% of one core for 8 GPUs at 1 Hz).

It runs the real sampler (NVML if a driver is present, the host always) for --seconds at --rate Hz,
optionally writing telemetry rows to a scratch SQLite file, and measures the CPU time of the process
(user + system, time.process_time) against wall time, minus an idle baseline measured in the same run
the same way. With GPUs it also times one NVML tick per GPU and extrapolates to --gpus GPUs.

    .venv/bin/python bench/bench_sampler.py --seconds 30 --rate 1 [--db] [--json OUT.json]

Prints medians of per-tick cost and the duty cycle (CPU seconds per wall second) in percent of one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path


def cpu_s() -> float:
    return time.process_time()  # user + system CPU of the whole process, ns resolution


def measure_idle(seconds: float) -> float:
    c0, w0 = cpu_s(), time.monotonic()
    threading.Event().wait(seconds)
    return (cpu_s() - c0) / (time.monotonic() - w0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--gpus", type=int, default=8, help="extrapolate the per-GPU tick cost to this many GPUs")
    parser.add_argument("--db", action="store_true", help="also write telemetry rows to a scratch SQLite file")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args()

    from ddtree.engine.machine.hw import nvml
    from ddtree.engine.machine.sampler import Sampler, SamplerConfig

    session = nvml()
    reason = session.reason  # NVML initialised once, outside the measured window
    sampler = Sampler(SamplerConfig(rate_hz=args.rate), session=session)
    for _ in range(3):  # warm-up: caches filled, imports done
        sampler.sample()

    db = None
    if args.db:
        import sqlite3

        from sqlite_utils import Database

        folder = tempfile.mkdtemp(prefix="bench-sampler-")
        # the sampler writes from its own thread
        db = Database(sqlite3.connect(Path(folder) / "t.db", check_same_thread=False))
        db["telemetry"].create({"id": int, "at": float, "gpu_index": int, "util": float, "mem_used": int,
                                "mem_total": int, "power_w": float, "temp_c": float}, pk="id")
        db["telemetry"].create_index(["at"])

    idle = measure_idle(min(5.0, args.seconds / 3))
    ticks: list[float] = []
    stop = threading.Event()
    c0, w0 = cpu_s(), time.monotonic()
    from ddtree.store.telemetry import TelemetryWriter

    sink = TelemetryWriter(db) if db is not None else None
    thread = sampler.start(stop, sink=sink, on_sample=lambda s: ticks.append(s.cost_s))
    stop.wait(args.seconds)
    stop.set()
    thread.join()
    wall = time.monotonic() - w0
    duty = (cpu_s() - c0) / wall - idle

    per_gpu = None
    if session.count:
        samples = []
        for _ in range(50):
            t0 = time.thread_time()
            session.sample(0)
            samples.append(time.thread_time() - t0)
        per_gpu = statistics.median(samples)
    result = {
        "nvml": reason or f"{session.count} GPU(s)",
        "rate_hz": args.rate, "seconds": round(wall, 2), "ticks": len(ticks), "db": bool(db),
        "tick_cpu_ms_median": round(1000 * statistics.median(ticks), 4) if ticks else None,
        "process_duty_pct_of_core": round(100 * duty, 4),
        "idle_baseline_pct": round(100 * idle, 4),
        "sampler_thread_cpu_s": round(sampler.cpu_s, 5),
        "nvml_tick_per_gpu_ms_median": round(1000 * per_gpu, 4) if per_gpu is not None else None,
    }
    if per_gpu is not None:
        # host part of a tick + one NVML tick per GPU, at the set rate
        host_part = max(0.0, statistics.median(ticks) - per_gpu * session.count)
        result[f"extrapolated_duty_pct_{args.gpus}_gpus"] = round(100 * args.rate * (host_part + args.gpus * per_gpu), 4)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
