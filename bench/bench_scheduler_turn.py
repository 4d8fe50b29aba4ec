"""What the scheduler itself costs the engine process per turn, with an engine that does nothing.

On a GPU a small model's batched round takes a few milliseconds, and the engine process's Python
work between rounds adds to it: classifying the running requests, building one Update per request,
the counters, and (with --engine-loop process) pickling the turn's updates and writing them to the
HTTP process. This runs the real `Scheduler` (and the real `_Outbox` over a socket pair, drained by
a forked reader) over --sessions requests whose rounds commit one token and cost nothing else, and
reports the CPU time of this process per turn: the scheduler's own cost, with no model and no HTTP.

With --engine-ms X each round first waits X ms with the GIL released, as a GPU round waits for its
walks, and the table adds the wall time per turn beyond that wait: the part of the scheduler's work
that the round does not hide (the outbox's sender thread runs during the wait). With
--engine-host-ms H the round also runs H ms of Python before and after the wait (half each), as a
fast round stages its rows and reads its walks, and the table adds how much longer the engine's
calls took than H + X ("engine+"): the sleep's overshoot alone, and with the outboxes, any wait
of the engine's thread for the GIL that their threads held on top. --outboxes N spreads the requests over N outboxes, one per HTTP process of
--tokenizer-worker-num N, each with its sender thread and its reader.

    .venv/bin/python bench/bench_scheduler_turn.py [--sessions 64] [--turns 300] [--repeats 5]
        [--engine-ms X] [--engine-host-ms H] [--outboxes N] [--baseline REV] [--out FILE.json]

Each measurement runs in a fresh subprocess; with --baseline REV the same measurement also runs
against a git worktree of REV (bench_http_side's baseline_tree), interleaved A B A B, and the table
gives each side's median and the ratio to this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class _Session:
    """Commits one token a round, as AR does; nothing else."""

    def __init__(self, n: int) -> None:
        self.n, self.output_ids, self.accept_lengths, self.verify_ct = n, [], [], 0
        self.done, self.finish_reason = False, None

    def step(self) -> list[int]:
        self.output_ids.append(7)
        self.accept_lengths.append(1)
        self.verify_ct += 1
        if len(self.output_ids) >= self.n:
            self.done, self.finish_reason = True, "length"
        return [7]

    def close(self) -> None:
        pass


class _Engine:
    block_size = 4

    def __init__(self, wait_s: float = 0.0, host_s: float = 0.0) -> None:
        self.wait_s, self.host_s = wait_s, host_s

    def start(self, ids, gen, spec) -> _Session:
        return _Session(gen.max_new_tokens)

    def step_many(self, sessions) -> list[list[int]]:
        _python_for(self.host_s / 2)  # staging the rows
        if self.wait_s:
            # A GPU round's wait for its walks, with the GIL released (fast/batch_graph.py _replay).
            time.sleep(self.wait_s)
        _python_for(self.host_s / 2)  # reading the walks
        return [s.step() for s in sessions]


def _python_for(seconds: float) -> None:
    """Python bytecode, holding the GIL (bar the interpreter's switches), for this long."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(50))


def measure(sessions: int, turns: int, outbox: bool, engine_ms: float = 0.0, host_ms: float = 0.0,
            outboxes: int = 1) -> dict:
    """One run in this process: CPU and wall seconds per turn."""
    from multiprocessing.connection import Connection

    from ddtree.engine.reference.params import GenParams, SpecParams
    from ddtree.engine.reference.scheduler import Scheduler

    from ddtree.engine.reference.engine_loop import _Outbox

    senders, readers = [], []
    pairs = [socket.socketpair() for _ in range(outboxes if outbox else 0)]
    for i, (a, b) in enumerate(pairs):
        reader = os.fork()
        if reader == 0:  # the HTTP side's stand-in: reads and drops every message
            for j, (other_a, other_b) in enumerate(pairs):  # no one else's end, so each sees its EOF
                other_a.close()
                if j != i:
                    other_b.close()
            conn = Connection(b.detach())
            try:
                while True:
                    conn.recv()
            except (EOFError, OSError):
                os._exit(0)
        readers.append(reader)
    for a, b in pairs:
        b.close()
        senders.append(_Outbox(Connection(a.detach())))

    def publish() -> None:
        for sender in senders:
            sender.flush()

    sched = Scheduler(_Engine(engine_ms / 1000, host_ms / 1000), max_running=sessions, max_queued=0, batch=True,
                      on_publish=publish if senders else None)
    finished = threading.Semaphore(0)
    tickets: dict[int, object] = {}

    def sink(tid: int, update) -> None:
        if senders:
            senders[tid % len(senders)].put(tid, tickets[tid], update)
        if update.done:
            finished.release()

    gen, spec = GenParams(max_new_tokens=turns), SpecParams("ar")
    for tid in range(sessions):
        tickets[tid] = sched.submit([1, 2, 3], gen, spec, lambda u, tid=tid: sink(tid, u))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sched.start()
    for _ in range(sessions):
        finished.acquire()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    engine_s = getattr(sched.stats, "engine_seconds_total", 0.0)
    sched.stop()
    for sender, reader in zip(senders, readers):
        if hasattr(sender, "drain"):  # this tree's outbox sends on a thread of its own
            sender.drain(10.0)
        sender.conn.close()
        os.waitpid(reader, 0)
    return {"cpu_us_per_turn": cpu / turns * 1e6, "wall_us_per_turn": wall / turns * 1e6,
            "exposed_us_per_turn": wall / turns * 1e6 - (engine_ms + host_ms) * 1000,
            # the engine's calls beyond what they were given to do: waits for the GIL
            "engine_excess_us_per_turn": engine_s / turns * 1e6 - (engine_ms + host_ms) * 1000}


def child_run(args: argparse.Namespace, env: dict | None, outbox: bool) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--sessions", str(args.sessions),
            "--turns", str(args.turns), "--engine-ms", str(args.engine_ms), "--engine-host-ms", str(args.engine_host_ms),
            "--outboxes", str(args.outboxes)] + (["--outbox"] if outbox else [])
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    if done.returncode:
        raise RuntimeError(f"a measurement failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64, help="running requests, one batched round a turn (default: 64)")
    p.add_argument("--turns", type=int, default=300, help="turns per measurement (default: 300)")
    p.add_argument("--repeats", type=int, default=5, help="measurements per side and mode (default: 5)")
    p.add_argument("--engine-ms", type=float, default=0.0,
                   help="each round waits this long with the GIL released, as a GPU round waits for its "
                        "walks; then the table also gives the wall time per turn beyond that wait (default: 0)")
    p.add_argument("--engine-host-ms", type=float, default=0.0,
                   help="each round also runs this much Python, half before and half after its wait, as a fast "
                        "round stages its rows and reads its walks (default: 0)")
    p.add_argument("--outboxes", type=int, default=1,
                   help="outboxes the requests are spread over, one per HTTP process (default: 1)")
    p.add_argument("--baseline", metavar="REV", help="also measure the scheduler of a git worktree of REV")
    p.add_argument("--out", metavar="FILE.json", help="write every measurement and the medians here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--outbox", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.sessions, args.turns, args.repeats, args.outboxes) < 1:
        p.error("--sessions, --turns, --repeats and --outboxes must be >= 1")
    if args.child:
        print(json.dumps(measure(args.sessions, args.turns, args.outbox, args.engine_ms, args.engine_host_ms,
                                 args.outboxes)))
        return 0
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"machine: {os.cpu_count()} cpus, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with ExitStack() as stack:
        sides = [("this tree", None)]
        if args.baseline:
            from bench_http_side import baseline_tree  # noqa: E402  (this folder is sys.path[0])

            base = baseline_tree(args.baseline, stack)
            sides.append((base.label, base.env))
        points = []
        for r in range(args.repeats):
            for outbox in (False, True):
                for label, env in sides:
                    point = dict(child_run(args, env, outbox), side=label, outbox=outbox, repeat=r)
                    points.append(point)
                    print(f"  {r} {label:>20} {'outbox' if outbox else 'scheduler only':>15}: "
                          f"{point['cpu_us_per_turn']:7.0f} us CPU per turn"
                          + (f", {point['exposed_us_per_turn']:7.0f} us of wall beyond the round's wait"
                             if args.engine_ms else "")
                          + (f", the engine's calls {point.get('engine_excess_us_per_turn', 0):5.0f} us over"
                             if args.engine_host_ms else ""), flush=True)
    rows = []
    for outbox in (False, True):
        first = None
        for label, _ in sides:
            mine = [q for q in points if q["side"] == label and q["outbox"] == outbox]
            cpu = [q["cpu_us_per_turn"] for q in mine]
            med = statistics.median(cpu)
            first = first or med
            rows.append({"side": label, "outbox": outbox, "cpu_us_per_turn": med, "min": min(cpu),
                         "max": max(cpu), "ratio": med / first,
                         "exposed_us_per_turn": statistics.median(q["exposed_us_per_turn"] for q in mine),
                         "engine_excess_us_per_turn": statistics.median(q.get("engine_excess_us_per_turn", 0)
                                                                        for q in mine)})
    print(f"\n{args.sessions} requests, {args.turns} turns, medians of {args.repeats}; CPU us per turn"
          + (f"; exposed: wall us per turn beyond the round's {args.engine_ms:g} ms wait" if args.engine_ms else ""))
    print(f"{'side':>22} {'what':>15} {'median':>8} {'min-max':>13} {'/ this tree':>12}"
          + (f" {'exposed':>8}" if args.engine_ms else "") + (f" {'engine+':>8}" if args.engine_host_ms else ""))
    for row in rows:
        print(f"{row['side']:>22} {'+ outbox' if row['outbox'] else 'scheduler only':>15} {row['cpu_us_per_turn']:8.0f} "
              f"{row['min']:6.0f}-{row['max']:<6.0f} {row['ratio']:12.3f}"
              + (f" {row['exposed_us_per_turn']:8.0f}" if args.engine_ms else "")
              + (f" {row['engine_excess_us_per_turn']:8.0f}" if args.engine_host_ms else ""))
    if args.engine_ms:
        # The outbox's own exposed cost, each repeat's outbox run less its scheduler-only run:
        # pairs taken close in time, so the machine's drift between repeats cancels.
        print("the outbox's exposed us per turn (paired with the same repeat's scheduler-only run):")
        for label, _ in sides:
            by = {(q["repeat"], q["outbox"]): q["exposed_us_per_turn"] for q in points if q["side"] == label}
            diffs = [by[r, True] - by[r, False] for r in range(args.repeats)]
            print(f"{label:>22} median {statistics.median(diffs):6.0f}  ({min(diffs):.0f} to {max(diffs):.0f})")
            rows.append({"side": label, "outbox_exposed_us_paired": statistics.median(diffs), "diffs": diffs})
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "points": points, "summary": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
