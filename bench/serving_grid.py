"""bench_server.py's --grid and --verify-grid (issue 15): the server against its own loop in process.

For each concurrency and each algorithm (ar, dflash, ddtree@budget for each budget):
- through ONE builtin server, batching on, with the project's sweep client
  (engine/serving/bench.py `run_point`): output tok/s, TTFT p50/p99, ITL p50/p99 and tau;
- in process, the same prompts and max_new_tokens (each prompt's own with --output-len-ratio)
  driven by the loop the server's scheduler runs (`drive`): up to `concurrency` sessions, new
  ones admitted at the next turn as others finish, fresh sessions prefilled together with
  `Engine.step_many` and the running ones stepped together with it; the same figures from the
  same percentile code.
Then server / in-process per cell, AR aggregate throughput at 16 (or the largest) over 1, the
concurrency at which each DDTree budget stops beating AR, and the issue's three targets.

--verify-grid times one batched target verify forward against batch size b and tokens per row q
(context --context): `Target.forward_batch` on the transformers backend, and on the fast backend
`ddtree.engine.reference.fast.batch.verify_timing(engine, b, q, context, repeats)` once it exists.

Everything the server side measures uses the engine the server builds; the in-process side loads
its own after the server has stopped, so the two never share the device. With --time-budget the
script stops starting new cells once its share of the budget is spent, and marks the rest
skipped; the JSON is rewritten after every cell, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

# Shares of --time-budget (from the script's start) past which no new cell of a part starts: the
# server cells first, then the in-process ones (which take about as long), the verify grid last.
SERVER_SHARE, INPROCESS_SHARE = 0.5, 0.9
VERIFY_UNAVAILABLE = "verify grid: fast batched forward not available"


@dataclass(frozen=True)
class Clock:
    """Seconds since the script started, against an optional budget."""

    t0: float
    budget_s: float | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self, share: float) -> bool:
        return self.budget_s is not None and self.elapsed() > share * self.budget_s

    def spent_after(self, start_s: float, share: float) -> bool:
        """Past `share` of the time left at `start_s` up to the in-process side's last start
        (INPROCESS_SHARE of the budget). A server's start is slow on a cold machine (198 s on an
        H100 while Triton and the graphs compiled): measured from the script's start, half the
        budget left its cells 14 s of a 480 s run."""
        if self.budget_s is None:
            return False
        left = max(0.0, INPROCESS_SHARE * self.budget_s - start_s)
        return self.elapsed() > start_s + share * left


def grid_specs(algorithms: list[str], budgets: list[int]) -> list[tuple[str, dict]]:
    """(name, the request's `speculative` object) per grid column: ddtree once per budget."""
    out = []
    for algorithm in algorithms:
        if algorithm == "ddtree":
            out += [(f"ddtree@{b}", {"algorithm": "ddtree", "budget": b}) for b in budgets]
        else:
            out.append((algorithm, {"algorithm": algorithm}))
    return out


def cell_prompts(args, concurrency: int) -> int:
    return max(args.num_prompts, args.waves * concurrency)


def prompts_for(args, concurrency: int):
    """The measured prompts of a cell, max(--num-prompts, --waves x concurrency), and its warm-up
    ones (a disjoint slice of the same dataset)."""
    from ddtree.engine.serving.prompts import load_prompts

    from ddtree.engine.serving.prompts import spread_output_lengths

    prompts = load_prompts(args.dataset, cell_prompts(args, concurrency), seed=0)
    warm = load_prompts(args.dataset, min(concurrency, 4), seed=0, offset=1000)
    ratio = getattr(args, "output_len_ratio", 1.0)
    return (spread_output_lengths(prompts, args.max_new_tokens, ratio),
            spread_output_lengths(warm, args.max_new_tokens, ratio, seed=1))


POINT_KEYS = ("requests_ok", "requests_failed", "output_tokens", "duration_s", "output_tok_s", "ttft_p50",
              "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "tau_weighted")


# -- the server side -----------------------------------------------------------------------------


def server_cell(url: str, args, concurrency: int, spec: dict, engine_pid: int | None = None, name: str = "") -> dict:
    from py_spy import sampled

    from ddtree.engine.serving.bench import BenchConfig, run_point

    prompts, warm = prompts_for(args, concurrency)
    cfg = BenchConfig(concurrency=concurrency, max_new_tokens=args.max_new_tokens, temperature=0.0,
                      speculative=spec)
    warmed = run_point(url, warm, cfg)  # the warm-up apart, so the turn counters below see only the cell
    before = engine_turns(url)
    collections: list = []
    with sampled(getattr(args, "py_spy", None), engine_pid, name), client_collections(collections):
        result = run_point(url, prompts, cfg)
    cell = {k: result.metrics.get(k) for k in POINT_KEYS}
    cell["client_gc"] = collections_during(collections, result.started_at, result.ended_at)
    if cell["client_gc"]["full"]:
        print(f"  (the client's full garbage collections during the point: {cell['client_gc']})", flush=True)
    cell.update(turn_figures(before, engine_turns(url)))
    # Since the server's warm-up: a count that grows in a cell is a first-use stall in it.
    cell["late_triton_compiles"] = ((server_info(url) or {}).get("internal_states") or [{}])[0].get(
        "late_triton_compiles")
    if warm and not any(r.ok for r in warmed.requests):
        result.warnings.append(f"every warm-up request failed ({len(warm)})")
    cell["prompts"] = len(prompts)
    cell["ttft_worst"] = worst_first_tokens(result.requests)
    cell["warnings"] = result.warnings
    failed = [r for r in result.requests if not r.ok]
    if failed:
        cell["first_failure"] = f"{failed[0].error}: {failed[0].detail}"
    return cell


@contextlib.contextmanager
def client_collections(out: list):
    """This process's garbage collections meanwhile, as (wall time at the start, generation,
    seconds): a full one in the client is a pause in the point's sending and reading."""
    started = [0.0, 0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = time.time(), time.perf_counter()
        else:
            out.append((started[0], info["generation"], time.perf_counter() - started[1]))
    gc.callbacks.append(hook)
    try:
        yield
    finally:
        gc.callbacks.remove(hook)


def collections_during(seen: list, start: float, end: float) -> dict:
    """The collections that began during the point's requests (not its warm-up or set-up)."""
    inside = [(g, s) for t, g, s in seen if start <= t <= end]
    return {"collections": len(inside), "full": sum(1 for g, _ in inside if g == 2),
            "ms": round(1000 * sum(s for _, s in inside), 2), "longest_ms": round(1000 * max((s for _, s in inside), default=0), 2)}


def engine_pid(proc) -> int | None:
    """The process that runs the server's rounds: its engine process (`python -m
    ddtree.engine.reference.engine_loop`, engine_loop.start) with --engine-loop process, else the
    server itself (--engine-loop thread)."""
    import psutil

    pid = getattr(getattr(proc, "proc", None), "pid", None)
    if pid is None:
        return None
    engines = [p.pid for p in psutil.Process(pid).children() if "ddtree.engine.reference.engine_loop" in p.cmdline()]
    return engines[0] if engines else pid


def worst_first_tokens(requests, n: int = 4) -> list[list[float]]:
    """The slowest first tokens as [start offset, TTFT] in ms: with a few dozen requests a
    cell's TTFT p99 is its worst one or two, and whether they started with the cell (the first
    wave's cohort) or joined running streams says which path made them slow."""
    timed = sorted((r for r in requests if r.ttft_s is not None), key=lambda r: r.ttft_s, reverse=True)
    return [[round(1000 * r.start_offset_s, 1), round(1000 * r.ttft_s, 1)] for r in timed[:n]]


TURN_KEYS = ("scheduler_turns_total", "scheduler_turn_seconds_total", "engine_seconds_total")


def engine_turns(url: str, settle_s: float = 0.02, reads: int = 5) -> dict | None:
    """The engine process's turn counters (/server_info), or None from a server without them.
    A turn's updates leave before the turn is counted, so this reads until two reads agree."""
    last = None
    for _ in range(reads):
        states = ((server_info(url) or {}).get("internal_states") or [{}])[0]
        now = {k: states[k] for k in TURN_KEYS} if all(k in states for k in TURN_KEYS) else None
        if now is None or now == last:
            return now
        last = now
        time.sleep(settle_s)
    return last


def turn_figures(before: dict | None, after: dict | None) -> dict:
    """A cell's turns, and per turn its wall ms and the ms inside engine calls: what the
    engine process adds to the rounds, against the in-process side's same figures."""
    if not before or not after:
        return {}
    turns = after["scheduler_turns_total"] - before["scheduler_turns_total"]
    if turns <= 0:
        return {}
    wall = after["scheduler_turn_seconds_total"] - before["scheduler_turn_seconds_total"]
    engine = after["engine_seconds_total"] - before["engine_seconds_total"]
    return {"turns": turns, "turn_ms": 1000 * wall / turns, "engine_ms_per_turn": 1000 * engine / turns,
            # the cell's turns in the server's --trace-turns file: numbers first + 1 .. last
            "turn_range": [before["scheduler_turns_total"], after["scheduler_turns_total"]]}


def server_info(url: str) -> dict | None:
    """/server_info after the grid: backend, CUDA graphs, average batch size, pool use once reported."""
    import httpx

    try:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            return client.get(url.rstrip("/") + "/server_info").json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def server_grid(args, url: str, specs, concurrencies: list[int], clock: Clock, save: Callable[[], None],
                cells: list[dict], share: float = SERVER_SHARE, label: str = "server",
                engine_pid: int | None = None) -> None:
    """Appends one cell per (concurrency, algorithm) to `cells`, in the order measured; no cell
    starts past `share` of the time left once the server is up (Clock.spent_after). engine_pid:
    the server's engine process, which --py-spy samples during each cell."""
    from ddtree.engine.serving.bench import BenchConfig, run_point

    ready = clock.elapsed()

    # Every prompt prefilled once, unmeasured: on CUDA the first forward at a new sequence length
    # pays for kernel selection, which would land on whichever cell came first.
    every = prompts_for(args, max(concurrencies))
    short = [replace(p, max_new_tokens=None) for p in every[0] + every[1]]  # 2 tokens each
    run_point(url, short, BenchConfig(concurrency=max(concurrencies), max_new_tokens=2,
                                      speculative={"algorithm": "ar"}))
    for i, c in enumerate(concurrencies):
        # The algorithm order rotates with the concurrency, so drift in machine load is spread.
        for name, spec in specs[i % len(specs):] + specs[:i % len(specs)]:
            if clock.spent_after(ready, share):
                cells.append({"concurrency": c, "algorithm": name, "skipped": "time budget"})
                continue
            t0 = time.perf_counter()
            cell = {"concurrency": c, "algorithm": name,
                    **server_cell(url, args, c, spec, engine_pid, f"{label}-c{c}-{name}"),
                    "wall_s": round(time.perf_counter() - t0, 2)}
            cells.append(cell)
            save()
            print(f"  {label:10s} c={c:3d} {name:10s} {line(cell)}", flush=True)


# -- the in-process side -------------------------------------------------------------------------


def drive(engine, prompts: list[list[int]], gen, spec, concurrency: int,
          lengths: list[int | None] | None = None) -> dict:
    """The server scheduler's loop without HTTP: each turn admits waiting prompts up to
    `concurrency` running sessions, prefills the fresh ones together, then steps the others
    together (`Engine.step_many`; one session alone steps by itself unless Engine.lone_round says
    otherwise, as the scheduler does; with
    --enable-mixed-chunk, fresh and running ones in one call, as the scheduler does then). A
    prompt arrives when an earlier session finishes (the sweep client's closed loop), so TTFT
    counts the wait for the next turn as it does through the server. ITL splits a round's gap
    over the tokens it brought, as the client does. lengths: each prompt's own max_new_tokens,
    where it sets one (Prompt.max_new_tokens), else gen's."""
    from ddtree.engine.serving.bench import percentile

    waiting = deque(range(len(prompts)))
    t0 = time.perf_counter()
    arrivals = deque([t0] * min(concurrency, len(prompts)))
    running: list[tuple[int, object]] = []
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    ttfts, itls, ends = [], [], []
    tokens = verifies = spec_tokens = 0
    arrived: dict[int, float] = {}

    def record(pairs, new_lists, now: float) -> None:
        for (i, _), new in zip(pairs, new_lists):
            if not new:
                continue
            if i not in first:
                first[i] = now
                ttfts.append(now - arrived[i])
            else:
                itls.extend([(now - last[i]) / len(new)] * len(new))
            last[i] = now

    # Turns, and the seconds inside engine calls, as the server's scheduler counts them.
    turns, turn_s, engine_s = 0, 0.0, 0.0

    def timed(fn, *args):
        nonlocal engine_s
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            engine_s += time.perf_counter() - t0

    gpu_wait = 0.0  # blocked on graphed rounds (Engine.turn_waits), to set beside the server's trace

    def step(group) -> None:
        nonlocal gpu_wait
        if len(group) > 1 or engine.lone_round(group[0][1]):  # as the scheduler routes one request
            new = timed(engine.step_many, [s for _, s in group])
            gpu_wait += (getattr(engine, "turn_waits", None) or {}).get("gpu", 0.0)
        else:
            new = [timed(s.step) for _, s in group]
        record(group, new, time.perf_counter())

    while waiting or running:
        turn_start = time.perf_counter()
        turns += 1
        while waiting and arrivals and len(running) < concurrency:
            i = waiting.popleft()
            arrived[i] = arrivals.popleft()
            own = lengths[i] if lengths else None
            asked = replace(gen, max_new_tokens=own) if own else gen
            running.append((i, timed(engine.start, prompts[i], asked, spec)))
        fresh = [(i, s) for i, s in running if not s.output_ids]
        live = [(i, s) for i, s in running if s.output_ids and not s.done]
        if fresh and len(live) > 1 and getattr(engine, "mixed_chunk", False):
            step(fresh + live)  # as the scheduler: a prefill chunk may ride in the round
        else:
            if fresh:
                step(fresh)
            if live:
                step(live)
        now = time.perf_counter()
        for pair in [p for p in running if p[1].done]:
            running.remove(pair)
            sess = pair[1]
            tokens += len(sess.output_ids)
            if spec.algorithm != "ar":  # as the server, which reports no acceptance for ar
                verifies += sess.verify_ct
                spec_tokens += len(sess.output_ids)
            timed(sess.close)
            ends.append(now)
            if waiting:
                arrivals.append(now)
        turn_s += time.perf_counter() - turn_start
    duration = (max(ends) - t0) if ends else 0.0
    return {"requests_ok": len(ends), "output_tokens": tokens, "duration_s": duration,
            "output_tok_s": tokens / duration if duration > 0 else None,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99),
            "tau_weighted": spec_tokens / verifies if verifies else None,
            "turns": turns, "turn_ms": 1000 * turn_s / turns if turns else None,
            "engine_ms_per_turn": 1000 * engine_s / turns if turns else None,
            "gpu_wait_ms_per_turn": 1000 * gpu_wait / turns if turns else None}


def load_engine(args, flags: list[str]):
    """The engine the server builds from the same options, with server.py's own loader and warm-up."""
    from ddtree.engine.reference import server

    t0 = time.perf_counter()
    parsed = server.build_parser().parse_args(flags)
    engine, model_path, draft_path = server._load(parsed)
    # The server's own warm-up (graphs, then a short generation of each kind it serves), so both
    # sides measure an engine past the same first-use work.
    server.warm_up(engine, server.settle_config(parsed, engine, model_path, draft_path),
                   progress=lambda _message: None)
    server.freeze_gc()  # as the server's engine process does once ready
    print(f"in-process engine: backend {engine.backend} ({engine.backend_reason}), cuda graphs {engine.graphs}, "
          f"KV pool {pool_usage(engine)}, loaded and warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
    return engine


def pool_usage(engine) -> dict | None:
    """Engine.pool_usage() (slots, free slots, bytes, tokens) where the engine has one."""
    usage = getattr(engine, "pool_usage", None)
    return usage() if usage is not None else None


def running_cap(engine, concurrency: int) -> int:
    """Sessions run at once: as the server, no more than the KV pool has slots (it lowers
    --max-running-requests to that)."""
    pool = pool_usage(engine)
    slots = pool.get("slots") if isinstance(pool, dict) else None
    return min(concurrency, slots) if slots else concurrency


def inprocess_grid(args, engine, specs, concurrencies: list[int], server_cells: list[dict] | None,
                   clock: Clock, save: Callable[[], None], cells: list[dict],
                   again_cells: list[dict] | None = None) -> None:
    """The cells the server side measured (every cell without one), each after a warm-up run of
    its warm-up prompts, as the sweep client warms a point up. With --again, each cell again per
    variant (see again()), into again_cells."""
    from py_spy import sampled

    from ddtree.engine.reference.engine import GenParams, SpecParams

    encode = engine.tokenizer.encode  # as the server's /generate tokenizes text
    measured = None if server_cells is None else {(c["concurrency"], c["algorithm"]) for c in server_cells
                                                  if "skipped" not in c}
    gen = GenParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    every = prompts_for(args, max(concurrencies))
    drive(engine, [list(encode(p.text)) for p in every[0] + every[1]], GenParams(max_new_tokens=2),
          SpecParams("ar"), running_cap(engine, max(concurrencies)))
    for i, c in enumerate(concurrencies):
        prompts, warm = prompts_for(args, c)
        ids = [list(encode(p.text)) for p in prompts]
        warm_ids = [list(encode(p.text)) for p in warm]
        lengths, warm_lengths = [p.max_new_tokens for p in prompts], [p.max_new_tokens for p in warm]
        for name, spec_dict in specs[i % len(specs):] + specs[:i % len(specs)]:
            if (measured is not None and (c, name) not in measured) or clock.spent(INPROCESS_SHARE):
                cells.append({"concurrency": c, "algorithm": name,
                              "skipped": "not measured on the server" if measured is not None
                              and (c, name) not in measured else "time budget"})
                continue
            spec = SpecParams(spec_dict["algorithm"], spec_dict.get("budget", SpecParams().budget))
            running = running_cap(engine, c)
            drive(engine, warm_ids, gen, spec, min(running, len(warm_ids)), warm_lengths)
            t0 = time.perf_counter()
            with sampled(getattr(args, "py_spy", None), os.getpid(), f"in-process-c{c}-{name}"):
                driven = drive(engine, ids, gen, spec, running, lengths)
            cell = {"concurrency": c, "algorithm": name, "prompts": len(ids), "running_cap": running,
                    **driven, "wall_s": round(time.perf_counter() - t0, 2)}
            cells.append(cell)
            save()
            print(f"  in-process c={c:3d} {name:10s} {line(cell)}", flush=True)
            for variant in getattr(args, "again", None) or []:
                if again_cells is None:
                    break
                t0 = time.perf_counter()
                driven = again(variant, lambda: drive(engine, ids, gen, spec, running, lengths), engine)
                cell = {**cell, **driven, "variant": variant, "wall_s": round(time.perf_counter() - t0, 2)}
                again_cells.append(cell)
                save()
                print(f"  in-process c={c:3d} {name:10s} {line(cell)}  (again: {variant})", flush=True)


def again(variant: str, run: Callable[[], dict], engine) -> dict:
    """One in-process cell run again in a setting of the server's engine process: "thread" drives
    it from a thread of its own (the server's rounds run on its EngineThread), "busyN" with N
    processes spinning beside it (the server's HTTP process and client keep cores busy);
    "noahead" with no round run ahead of the host (the server's --disable-overlap-schedule)."""
    if variant == "noahead":
        if not hasattr(engine.impl, "round_ahead"):  # the transformers backend: nothing runs ahead
            return run()
        saved = engine.impl.round_ahead
        engine.impl.round_ahead = False
        try:
            return run()
        finally:
            engine.impl.round_ahead = saved
    if variant == "thread":
        out: list = []
        worker = threading.Thread(target=lambda: out.append(run()), name="drive")
        worker.start()
        worker.join()
        if not out:
            raise RuntimeError("the drive thread failed (its traceback is above)")
        return out[0]
    with spinning(int(variant[len("busy"):])):
        return run()


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """n processes that only spin, as the server's HTTP process and client keep cores busy beside
    its engine: whether busier cores alone (a lower clock, shared caches) slow the rounds."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


# -- the summary ---------------------------------------------------------------------------------


def _ms(value) -> str:
    return f"{1000 * value:7.1f}" if isinstance(value, (int, float)) else f"{'-':>7s}"


def _num(value, fmt: str = "8.1f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else format("-", ">" + fmt.split(".")[0])


def line(cell: dict) -> str:
    return (f"{_num(cell.get('output_tok_s'))} tok/s  TTFT p50/p99 {_ms(cell.get('ttft_p50'))} /"
            f"{_ms(cell.get('ttft_p99'))} ms  ITL p50/p99 {_ms(cell.get('itl_p50'))} /{_ms(cell.get('itl_p99'))} ms"
            f"  tau {_num(cell.get('tau_weighted'), '5.2f')}  ({cell.get('wall_s')} s)"
            + (f"  {cell['turns']} turns of {cell['turn_ms']:.2f} ms, {cell['engine_ms_per_turn']:.2f} in the engine"
               if cell.get("turns") else "")
            + (f", {cell['gpu_wait_ms_per_turn']:.2f} waiting on rounds" if cell.get("gpu_wait_ms_per_turn") else "")
            + (f"  slowest first tokens (start, TTFT ms) {cell['ttft_worst'][:2]}" if cell.get("ttft_worst") else ""))


def summarize(server: list[dict] | None, inprocess: list[dict] | None, specs, concurrencies: list[int]) -> dict:
    """Per cell, both sides and server / in-process; AR scaling; the DDTree crossover; the targets."""

    def index(cells):
        return {(c["concurrency"], c["algorithm"]): c for c in cells or [] if "skipped" not in c}

    srv, inp = index(server), index(inprocess)
    rows = []
    for c in concurrencies:
        for name, _ in specs:
            s, p = srv.get((c, name)), inp.get((c, name))
            ratio = None
            if s and p and s.get("output_tok_s") and p.get("output_tok_s"):
                ratio = s["output_tok_s"] / p["output_tok_s"]
            rows.append({"concurrency": c, "algorithm": name, "server": s, "inprocess": p,
                         "server_over_inprocess": ratio})
    out: dict = {"rows": rows}

    def tok_s(side, c, name):
        cell = side.get((c, name))
        return cell.get("output_tok_s") if cell else None

    for label, side in (("server", srv), ("inprocess", inp)):
        top = 16 if 16 in concurrencies else max(concurrencies)
        one, many = tok_s(side, 1, "ar"), tok_s(side, top, "ar")
        out[f"ar_scaling_{label}"] = {"concurrency": top, "ratio": many / one if one and many else None}
        crossover, over_ar = {}, {}
        for name, _ in specs:
            if not name.startswith("ddtree"):
                continue
            pairs = [(c, tok_s(side, c, name), tok_s(side, c, "ar")) for c in concurrencies]
            pairs = [(c, d, a) for c, d, a in pairs if d and a]
            # The first concurrency measured where DDTree is no faster than AR; None: it beat AR
            # at every one measured (or nothing was measured).
            crossover[name] = next((c for c, d, a in pairs if d <= a), None)
            # DDTree / AR at each concurrency: on a small pair DDTree can lose at c=1 and win at
            # c=64 (the demo pair on an H100), which the first loss alone does not show.
            over_ar[name] = {c: round(d / a, 3) for c, d, a in pairs}
        out[f"crossover_{label}"] = crossover
        out[f"ddtree_over_ar_{label}"] = over_ar
    ratios = [r["server_over_inprocess"] for r in rows if r["server_over_inprocess"] is not None]
    c16 = srv.get((16, "ar"))
    scaling = out["ar_scaling_server"]
    out["targets"] = {
        "ar_c16_ge_10x_c1": (scaling["ratio"] >= 10 if scaling["ratio"] is not None and scaling["concurrency"] == 16
                             else None),
        "server_within_10pct_of_inprocess": all(r >= 0.9 for r in ratios) if ratios else None,
        "itl_p99_le_2x_p50_at_c16": (c16["itl_p99"] <= 2 * c16["itl_p50"]
                                     if c16 and c16.get("itl_p99") is not None and c16.get("itl_p50") else None),
    }
    return out


def print_summary(summary: dict) -> None:
    print()
    print(f"{'c':>4s} {'algorithm':10s} | {'server tok/s':>12s} {'TTFT p50':>8s} {'p99':>7s} {'ITL p50':>8s} "
          f"{'p99':>7s} {'tau':>5s} | {'in-proc tok/s':>13s} {'ITL p50':>8s} {'p99':>7s} | {'srv/in':>6s}")
    for r in summary["rows"]:
        s, p = r["server"] or {}, r["inprocess"] or {}
        ratio = r["server_over_inprocess"]
        print(f"{r['concurrency']:4d} {r['algorithm']:10s} | {_num(s.get('output_tok_s'), '12.1f')} "
              f"{_ms(s.get('ttft_p50')):>8s} {_ms(s.get('ttft_p99'))} {_ms(s.get('itl_p50')):>8s} "
              f"{_ms(s.get('itl_p99'))} {_num(s.get('tau_weighted'), '5.2f')} | "
              f"{_num(p.get('output_tok_s'), '13.1f')} {_ms(p.get('itl_p50')):>8s} {_ms(p.get('itl_p99'))} | "
              f"{_num(ratio, '6.2f')}")
    print("(times in ms)")
    for label in ("server", "inprocess"):
        sc = summary[f"ar_scaling_{label}"]
        print(f"AR throughput c={sc['concurrency']} / c=1 ({label}): {_num(sc['ratio'], '.2f')}; "
              f"DDTree no faster than AR from c= {summary[f'crossover_{label}']}; "
              f"DDTree / AR tok/s by c: {summary.get(f'ddtree_over_ar_{label}')}")
    print(f"targets: {summary['targets']}")


# -- the verify grid -----------------------------------------------------------------------------


def verify_grid(args, engine, transformers_verifier) -> dict:
    """ms of one batched verify forward per (b rows, q tokens per row), context --context per row.
    `transformers_verifier(engine, b, q, ctx, seed)` is bench_server's timer for that backend."""
    import torch

    from ddtree.engine.reference.errors import BadParams

    out: dict = {"backend": engine.backend, "context": args.context, "repeats": args.repeats, "rows": []}
    if engine.backend == "fast":
        try:
            from ddtree.engine.reference.fast.batch import verify_timing
        except (ImportError, AttributeError):
            print(VERIFY_UNAVAILABLE, flush=True)
            out["skipped"] = VERIFY_UNAVAILABLE
            return out

        def time_ms(b: int, q: int) -> float:
            return float(verify_timing(engine, b, q, args.context, args.repeats))
    else:
        def time_ms(b: int, q: int) -> float:
            run = transformers_verifier(engine, b, q, args.context, seed=b * 1000 + q)
            for _ in range(2):  # the first calls of a shape pay for allocation and kernel choice
                run()
            ms = 1000 * statistics.median([run() for _ in range(args.repeats)])
            del run
            if engine.device.startswith("cuda"):
                torch.cuda.empty_cache()
            return ms

    base = None
    for b in args.verify_b:
        for q in args.verify_q:
            try:
                ms = time_ms(b, q)
            except BadParams as exc:  # e.g. a KV pool with fewer slots than b rows
                out["rows"].append({"b": b, "q": q, "skipped": str(exc)})
                print(f"  verify b={b:3d} q={q:3d}: skipped ({exc})", flush=True)
                continue
            base = base or ms  # the first point, (b, q) = (1, 1) by default: one decode step
            row = {"b": b, "q": q, "ms": ms, "ms_per_row": ms / b, "tokens_per_s": b * q / (ms / 1000),
                   "x_first": ms / base}
            out["rows"].append(row)
            print(f"  verify b={b:3d} q={q:3d}: {ms:8.2f} ms ({row['ms_per_row']:7.3f} ms/row, "
                  f"x{row['x_first']:.2f} of the first point)", flush=True)
    return out


# -- the whole mode ------------------------------------------------------------------------------


def loop_flags(loop: str) -> list[str]:
    """The server flags of one --engine-loops value: thread, process, or process-wN (process with N
    HTTP processes, --tokenizer-worker-num N); +PARTs after either set the server's environment
    (loop_env). A value given again is labelled VALUE#2, #3 ... (loop_labels)."""
    where, _, workers = loop.partition("#")[0].partition("+")[0].partition("-w")
    noahead = ["--disable-overlap-schedule"] if "noahead" in loop.partition("#")[0].split("+")[1:] else []
    return ["--engine-loop", where] + (["--tokenizer-worker-num", workers] if workers else []) + noahead


def loop_labels(loops: list[str]) -> list[str]:
    """Each --engine-loops value as the grid names its server: a value given again gets #2, #3
    ..., so one grid can run the same server twice (A B A B)."""
    labels: list[str] = []
    for loop in loops:
        n = loops[:len(labels)].count(loop)
        labels.append(loop if n == 0 else f"{loop}#{n + 1}")
    return labels


@contextlib.contextmanager
def loop_env(loop: str) -> Iterator[None]:
    """The environment of a server started inside, from a loop value's +PARTs: wait, thread or
    inline set DDTREE_OUTBOX (engine_loop._Outbox's mode), rideN DDTREE_RIDE_ROW (fast/ride.py's
    row width when several joiners ride), burstN DDTREE_BURST_ROUNDS (ride.BURST_ROUNDS), so one
    grid measures one setting against another."""
    env = {}
    for part in loop.partition("#")[0].split("+")[1:]:
        if part == "noahead":  # a server flag (loop_flags)
            continue
        setting = re.fullmatch(r"(ride|burst)([1-9][0-9]*)", part)
        if setting:
            from ddtree.engine.reference.fast.ride import OVERRIDES

            env[OVERRIDES[setting.group(1)][0]] = setting.group(2)
        else:
            env["DDTREE_OUTBOX"] = part
    with mock.patch.dict(os.environ, env):  # put back as it was after
        yield


def run_grid(args, server_flags: Callable[[int], list[str]], start_server: Callable[[list[str], str], object],
             report: dict, save: Callable[[], None], clock: Clock, transformers_verifier) -> None:
    """--grid and/or --verify-grid into report["grid"] / report["verify_grid"]. `server_flags(
    max_running)` are the one batching server's options, `start_server(flags, log_name)` starts it;
    the in-process engine is loaded from the same options."""
    specs = grid_specs(args.algorithms.split(","), args.budget_list)
    concurrencies = args.concurrency_list
    # The verify grid's b rows run in the in-process engine's KV pool, which (once the server
    # sizes one) follows --max-running-requests: room for the largest b as well.
    flags = server_flags(max(concurrencies + (args.verify_b if args.verify_grid else [])))
    grid: dict = {"server_flags": flags, "concurrencies": concurrencies, "algorithms": [n for n, _ in specs],
                  "max_new_tokens": args.max_new_tokens, "backend_asked": args.backend, "dtype": args.dtype,
                  "prompts_per_cell": {c: cell_prompts(args, c) for c in concurrencies}}
    timings: dict = {}
    grid["part_s"] = timings
    if args.grid:
        report["grid"] = grid
    server_cells: list[dict] | None = None
    loops = loop_labels(list(getattr(args, "engine_loops", None) or ["process"]))
    if args.grid and not args.skip_serving:
        # One server per --engine-loops value, each with its share of the server time, so the
        # engine loop in its own process and on a thread are measured in the same run.
        grid["servers"] = {}
        inprocess_next = not args.skip_inprocess
        for k, loop in enumerate(loops):
            cells = grid["servers"][loop] = []
            if k and inprocess_next and clock.spent(SERVER_SHARE):
                # A later server would leave the in-process side, the ratio's denominator, no time
                # (three servers on a cold H100 took 400 s of a 440 s budget, and every in-process
                # cell was skipped).
                cells += [{"concurrency": c, "algorithm": name, "skipped": "time budget"}
                          for c in concurrencies for name, _ in specs]
                print(f"server ({' '.join(loop_flags(loop))}) not started: past {SERVER_SHARE:.0%} of the "
                      "time budget, and the in-process side is still to run", flush=True)
                continue
            t0 = time.perf_counter()
            trace = []
            if getattr(args, "trace_turns", None):  # the server appends: a file of this run only
                trace = ["--trace-turns", f"{args.trace_turns}-{loop}.jsonl"]
                Path(trace[1]).unlink(missing_ok=True)
            with loop_env(loop):
                proc = start_server(flags + loop_flags(loop) + trace, f"server-grid-{loop}.log")
            try:
                timings[f"server_start_{loop}"] = round(time.perf_counter() - t0, 1)
                print(f"server ({' '.join(loop_flags(loop))}) up in {timings[f'server_start_{loop}']} s at {proc.url}",
                      flush=True)
                t0 = time.perf_counter()
                server_grid(args, proc.url, specs, concurrencies, clock, save, cells,
                            share=SERVER_SHARE * (k + 1) / len(loops), label=f"srv-{loop}",
                            engine_pid=engine_pid(proc))
                grid.setdefault("server_info", {})[loop] = server_info(proc.url)
                timings[f"server_cells_{loop}"] = round(time.perf_counter() - t0, 1)
            finally:
                proc.stop(60)
            save()
        server_cells = [cell for loop in loops for cell in grid["servers"][loop]]
    engine = None
    if (args.grid and not args.skip_inprocess) or args.verify_grid:
        t0 = time.perf_counter()
        engine = load_engine(args, flags)
        timings["engine_load"] = round(time.perf_counter() - t0, 1)
        report["inprocess_engine"] = {"backend": engine.backend, "backend_reason": engine.backend_reason,
                                      "cuda_graphs": engine.graphs, "kv_pool": pool_usage(engine)}
    if args.grid and not args.skip_inprocess:
        grid["inprocess"] = []
        if getattr(args, "again", None):
            grid["inprocess_again"] = []
        t0 = time.perf_counter()
        inprocess_grid(args, engine, specs, concurrencies, server_cells, clock, save, grid["inprocess"],
                       grid.get("inprocess_again"))
        timings["inprocess_cells"] = round(time.perf_counter() - t0, 1)
    if args.grid:
        by_loop = grid.get("servers") or {loops[0]: None}
        grid["summary_by_loop"] = {loop: summarize(cells, grid.get("inprocess"), specs, concurrencies)
                                   for loop, cells in by_loop.items()}
        save()
        for loop, summary in grid["summary_by_loop"].items():
            print(f"\n{loop} ({' '.join(loop_flags(loop))}):")
            print_summary(summary)
    if args.verify_grid:
        if clock.spent(1.0):
            report["verify_grid"] = {"skipped": "time budget"}
        else:
            print("verify forward cost by batch size and tokens per row:", flush=True)
            t0 = time.perf_counter()
            report["verify_grid"] = verify_grid(args, engine, transformers_verifier)
            timings["verify_grid"] = round(time.perf_counter() - t0, 1)
        save()
