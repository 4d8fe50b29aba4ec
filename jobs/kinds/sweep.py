"""The `sweep` job kind: run a recipe's grid against an engine and fill the store point by point.

Spec: `{"run_id": N}` runs (or resumes) a run row that already holds its recipe (the CLI creates
it); `{"recipe": {...}, "recipe_path": ..., "recipe_git_rev": ...}` creates the run first. Either
way the same loop follows: plan the grid, create the missing point rows, skip points already
`done` or `skipped`, and for each engine launch with work left start the engine, wait for /health,
run its points, stop it.

Engines: the builtin server is started on port 0 and its listening line is read from its log;
SGLang and vLLM get the launch spec of jobs/plan.py rebuilt with a port free at that moment, their
GPUs checked first (they exist, nothing else holds them, the weights fit), CPUs pinned to the GPUs'
NUMA node (numactl or taskset in the command; with neither installed the runner sets the child's
CPU affinity right after it starts, long before it loads anything), and /health polled up to the
recipe's ready timeout. A start that fails is classified from the engine's log (out of memory,
NCCL, port in use, missing model files, unsupported flag ...) and that reason is what the points,
the engine row and the job carry; a port lost to a race is retried once on a new port.

Acceptance per point comes two ways: per request from meta_info (engine/bench.py), and over the
point from the difference of the server's Prometheus counters scraped just before and just after
it (warm-up excluded) -> points.tau_counters. The cumulative /server_info figure is never used.

A point that fails (every request failed, the engine died) is recorded with its cause and the
sweep goes on; the engine is restarted for the next point if it died. A point whose error rate or
p99 latency crosses the recipe's limits marks the higher concurrencies of its series `skipped`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from itertools import groupby
from pathlib import Path

from ddtree.engine.contention import Watch, busy_note, busy_reasons
from ddtree.engine.bench import BenchConfig, EngineNotReady, PointResult, run_point, wait_ready
from ddtree.engine.errors import EngineError
from ddtree.engine.launch import LaunchSpec
from ddtree.engine.logclass import classify_tail
from ddtree.engine.metrics import (SGLANG_REQUESTS, MetricsError, RunAcceptance, Scrape, fetch_scrape,
                                   run_acceptance)
from ddtree.engine.preflight import PreflightError, check_gpus, preflight
from ddtree.engine.prompts import load_prompts
from ddtree.jobs.errors import JobCancelled, JobError
from ddtree.jobs.logfile import error_tail
from ddtree.jobs.plan import (Hardware, Launch, Plan, PlanPoint, UnsupportedEngine, box_line, make_plan,
                              repeat_note)
from ddtree.jobs.recipe import Recipe, RecipeError, recipe_from_dict, recipe_to_dict
from ddtree.store import sweeps
from ddtree.store.contention import record_contention
from ddtree.store.db import open_db

STOP_GRACE_S = 10.0
# Our previous engine on the same GPUs has just exited; the driver may list it for a moment more.
GPU_BUSY_WAIT_S = 20.0
# SGLang counts a request in its counters as it finishes it, which may be just after the client
# has the response: the scrape after a point waits this long at most for the counts to settle.
COUNTER_SETTLE_S = 3.0
PORT_RETRIES = 1
SOFTWARE = ("ddtree-console", "torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "httpx",
            "sglang", "vllm", "flashinfer-python")


class SweepSpecError(JobError):
    exit_code = 2


class EngineStartError(JobError):
    """The engine process exited or did not report where it listens."""


def validate(spec: dict) -> dict:
    if not isinstance(spec, dict):
        raise SweepSpecError("a sweep spec must be an object")
    if "run_id" in spec:
        run_id = spec["run_id"]
        if isinstance(run_id, bool) or not isinstance(run_id, int) or not 1 <= run_id < 2**63:  # SQLite's range
            raise SweepSpecError(f"run_id must be a positive integer, got {run_id!r}")
        extra = set(spec) - {"run_id"}
        if extra:
            raise SweepSpecError(f"unknown sweep spec keys with run_id: {', '.join(sorted(extra))}")
        return {"run_id": run_id}
    if "recipe" not in spec:
        raise SweepSpecError("a sweep spec needs 'recipe' (a recipe table) or 'run_id'")
    extra = set(spec) - {"recipe", "recipe_path", "recipe_git_rev"}
    if extra:
        raise SweepSpecError(f"unknown sweep spec keys: {', '.join(sorted(extra))}")
    recipe = recipe_from_dict(spec["recipe"])
    check_supported(recipe)
    return {"recipe": recipe_to_dict(recipe), "recipe_path": spec.get("recipe_path"),
            "recipe_git_rev": spec.get("recipe_git_rev")}


def check_supported(recipe: Recipe) -> None:
    """The checks that need no subprocess (the console's form runs them on every keystroke):
    an sglang/vllm interpreter given as a path must exist. What the interpreter's engine accepts
    is checked by `jobs.plan.make_plan` + `check_plan` (the CLI does, before submitting)."""
    python = recipe.engine.python
    if recipe.engine.kind != "builtin" and python and os.sep in python and not os.path.exists(python):
        raise UnsupportedEngine(f"engine.python {python} does not exist",
                                f"point it at the interpreter of the venv that has {recipe.engine.kind} installed")


# -- environment fingerprint ---------------------------------------------------------------------


def software_versions(python: str | None = None) -> dict:
    """Versions of the packages that decide the figures, from this interpreter (no imports) and,
    when the engine runs under another one, from that interpreter too."""
    out: dict = {"python": platform.python_version(), "platform": platform.platform(), "packages": {}}
    for name in SOFTWARE:
        try:
            out["packages"][name] = version(name)
        except PackageNotFoundError:
            continue
    if python and os.path.realpath(python) != os.path.realpath(sys.executable):
        script = ("import json, platform\nfrom importlib.metadata import version\nout = {}\n"
                  f"for n in {list(SOFTWARE)!r}:\n    try: out[n] = version(n)\n    except Exception: pass\n"
                  "print(json.dumps({'python': platform.python_version(), 'packages': out}))")
        try:
            done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60,
                                  start_new_session=True, stdin=subprocess.DEVNULL)
            out["engine_python"] = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-300:]}
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            out["engine_python"] = {"error": str(exc)}
    return out


def hardware_fingerprint(data_dir: str | None = None) -> dict:
    """What makes two runs comparable: GPUs (model, memory, bus, NUMA, links), driver, CPU, memory."""
    from ddtree.engine.host import host_info
    from ddtree.engine.hw import gpu_view

    view = gpu_view()
    host = host_info(data_dir=data_dir)
    gpus = [{"index": g.index, "name": g.name, "uuid": g.uuid, "bus_id": g.bus_id, "numa_node": g.numa_node,
             "memory_total": g.memory_total, "power_cap_w": g.power_cap_w, "pcie_gen_max": g.pcie_gen_max,
             "pcie_width_max": g.pcie_width_max, "nvlinks": len(g.nvlinks)} for g in view.gpus]
    return {
        "gpus": gpus, "links": view.links, "driver_version": view.driver_version,
        "cuda_driver_version": view.cuda_driver_version, "gpu_reason": view.reason,
        "host": {"hostname": host.hostname, "cpu_model": host.cpu_model, "cpus_logical": host.cpus_logical,
                 "cpus_physical": host.cpus_physical, "memory_total": host.memory_total,
                 "numa": [{"node": n.node, "cpus": len(n.cpus)} for n in host.numa]},
    }


# -- the engine process --------------------------------------------------------------------------


class EngineStartFailed(EngineStartError):
    """The engine never became ready; `reason` is the classified cause from its log."""

    def __init__(self, message: str, hint: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message, hint)
        self.code = code


class EngineProcess:
    """One launch of the engine under the job: checked, spawned, located, stopped."""

    def __init__(self, ctx, plan: Plan, launch: Launch, attempt: int) -> None:
        self.ctx, self.plan, self.launch, self.recipe = ctx, plan, launch, plan.recipe
        self.attempt = attempt
        self.name = f"engine-{launch.index}-{attempt}"
        self.proc: subprocess.Popen | None = None
        self.spec: LaunchSpec | None = None
        self.url: str | None = None
        self.row_id: int | None = None

    def exited(self) -> str | None:
        if self.proc is None:
            return "not started"
        code = self.proc.poll()
        return None if code is None else f"exit code {code}; see {self.log_path()}"

    def log_path(self) -> str | None:
        row = self.ctx.db.execute("SELECT log_path FROM processes WHERE job_id = ? AND name = ? ORDER BY id DESC",
                                  [self.ctx.job_id, self.name]).fetchone()
        return row[0] if row else None

    def start(self) -> str:
        """Start the engine and wait until it answers /health; its URL. Raises EngineStartFailed
        (with the cause read from the engine's log), PreflightError or another EngineError."""
        launch = self.launch
        if launch.gpus:
            _check_launch_gpus(self.ctx, self.recipe, launch)
        self.spec = self.plan.launch_spec(launch)
        self.ctx.log(f"engine {self.name}: {self.spec.command_line()}")
        for note in self.spec.notes:
            self.ctx.log(f"engine {self.name}: note: {note}")
        self.proc = self.ctx.spawn(list(self.spec.argv), env=self.spec.spawn_env(), name=self.name)
        if self.spec.numa == "runner" and self.spec.cpu_affinity:
            # At once: the interpreter is still starting, long before SGLang spawns its workers.
            self.ctx.log(f"engine {self.name}: {_pin_cpus(self.proc.pid, self.spec.cpu_affinity)}")
        self._record_start()
        t0 = time.monotonic()
        try:
            self.url = self._locate(t0) if self.spec.announces_url else self.spec.base_url
            wait_ready(self.url, timeout_s=max(1.0, self._timeout() - (time.monotonic() - t0)), alive=self.exited)
        except (EngineNotReady, EngineStartError) as exc:
            verdict = classify_tail(self.log_path())
            reason = verdict.describe() if verdict else str(exc)
            self._record_end("failed", reason)
            raise EngineStartFailed(reason, code=verdict.code if verdict else None) from None
        self.ctx.log(f"engine {self.name} ready at {self.url} after {time.monotonic() - t0:.1f}s")
        with sweeps._write(self.ctx.db, "the engine row") as tx:
            tx.execute("UPDATE engines SET state = 'running', base_url = ?, port = ?, ready_at = ? WHERE id = ?",
                       [self.url, int(self.url.rsplit(":", 1)[1]), time.time(), self.row_id])
        return self.url

    def _timeout(self) -> float:
        return self.recipe.engine.ready_timeout_s

    def _locate(self, t0: float) -> str:
        """The builtin server picks its own port and prints it on stdout (into its log)."""
        log = self.log_path()
        timeout = self._timeout()
        while True:
            url = _listening_url(log) if log is not None else None
            if url is not None:
                return url
            gone = self.exited()
            if gone:
                raise EngineStartError(f"engine exited while starting ({gone})", _log_tail(log))
            if time.monotonic() - t0 > timeout:
                raise EngineNotReady(f"engine did not report a listening address within {timeout:g}s",
                                     "raise engine.ready_timeout_s, or read " + str(log))
            self.ctx.sleep(0.2)

    def _record_start(self) -> None:
        engine, spec = self.recipe.engine, self.spec
        now = time.time()
        values = {"job_id": self.ctx.job_id, "kind": engine.kind, "model": engine.model or "demo",
                  "draft_model": engine.draft_model or ("demo" if engine.model is None else None),
                  "algorithm": self.launch.algorithm, "budget": self.launch.budget, "block_size": engine.block_size,
                  "tp": self.launch.tp, "gpus": json.dumps(list(self.launch.gpus)),
                  "python": engine.python or sys.executable, "extra_args": json.dumps(list(engine.extra_args)),
                  "base_url": spec.base_url, "host": spec.host, "port": spec.port or None, "pid": self.proc.pid,
                  "pgid": self.proc.pid, "log_path": self.log_path(), "state": "starting", "created_at": now}
        with sweeps._write(self.ctx.db, "the engine row") as tx:
            cur = tx.execute(f"INSERT INTO engines ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                             list(values.values()))
        self.row_id = int(cur.lastrowid)

    def _record_end(self, state: str, error: str | None = None) -> None:
        if self.row_id is None:
            return
        with sweeps._write(self.ctx.db, "the engine row") as tx:
            tx.execute("UPDATE engines SET state = ?, error = coalesce(?, error), ended_at = ? WHERE id = ?",
                       [state, error, time.time(), self.row_id])

    def died_reason(self) -> str | None:
        """Why the engine exited (classified from its log), or None while it runs."""
        gone = self.exited()
        if not gone:
            return None
        verdict = classify_tail(self.log_path())
        return f"{gone}: {verdict.describe()}" if verdict else gone

    def stop(self) -> None:
        if self.proc is None:
            return
        died = self.died_reason()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                self.proc.wait(timeout=10)
        if hasattr(self.ctx, "poll_children"):
            self.ctx.poll_children()
        row = self.ctx.db.execute("SELECT state FROM engines WHERE id = ?", [self.row_id]).fetchone() \
            if self.row_id is not None else None
        if row is not None and row[0] != "failed":
            self._record_end("failed" if died else "stopped", died)


def start_engine(ctx, plan: Plan, launch: Launch, attempt: int) -> tuple[EngineProcess, int]:
    """Start `launch`, retrying on a fresh port when the one chosen was taken in the meantime;
    (the running engine, the next attempt number)."""
    for retry in range(PORT_RETRIES + 1):
        engine = EngineProcess(ctx, plan, launch, attempt)
        attempt += 1
        try:
            engine.start()
            return engine, attempt
        except EngineStartFailed as exc:
            engine.stop()
            if exc.code != "port_in_use" or launch.kind == "builtin" or retry == PORT_RETRIES:
                raise
            ctx.log(f"engine {engine.name}: {exc}; retrying on another port")
        except BaseException:
            engine.stop()
            raise
    raise AssertionError("unreachable")


def _check_launch_gpus(ctx, recipe: Recipe, launch: Launch) -> None:
    """Right before a launch: its GPUs exist, nothing else holds them, and the weights fit.
    Raises PreflightError (the reason names the GPU or the sizes)."""
    from ddtree.engine.hw import gpu_view

    view = gpu_view()
    if not view.gpus:
        ctx.log(f"GPUs {list(launch.gpus)} not checked before the launch: {view.reason or 'NVML sees none'}")
        return
    visible = [g.index for g in view.gpus]
    check_gpus(launch.gpus, launch.tp, visible=visible)
    deadline = time.monotonic() + GPU_BUSY_WAIT_S
    while True:
        by_index = {g.index: g for g in view.gpus}
        used = {i: g.memory_used for i, g in by_index.items() if g.memory_used is not None}
        procs = {i: len(g.processes) for i, g in by_index.items()}
        try:
            check_gpus(launch.gpus, launch.tp, used_bytes=used, processes=procs)
            break
        except PreflightError:
            if time.monotonic() > deadline:
                raise
        ctx.sleep(1.0)
        view = gpu_view()
    totals = [by_index[g].memory_total for g in launch.gpus]
    if recipe.engine.model is not None and None not in totals:
        report = preflight(recipe.engine.model, recipe.engine.draft_model, totals, launch.tp)
        if report is not None:
            ctx.log(f"engine {launch.index} fits: {report.describe()}")


def _pin_cpus(pid: int, cpus: tuple[int, ...]) -> str:
    """Pin every thread of a just-started child to `cpus` (neither numactl nor taskset exists).
    Threads and processes it starts later inherit the mask."""
    if not hasattr(os, "sched_setaffinity"):
        return "CPU affinity not set: this platform has no sched_setaffinity"
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    try:
        for task in tasks:
            os.sched_setaffinity(task, cpus)
    except OSError as exc:
        return f"CPU affinity not set: {exc.strerror or exc}"
    from ddtree.engine.hw import format_cpulist

    return f"CPU affinity of pid {pid} set to {format_cpulist(list(cpus))} by the runner (no numactl or taskset)"


def _listening_url(log_path: str) -> str | None:
    try:
        with open(log_path, "rb") as fh:
            for raw in fh:
                line = raw.decode(errors="replace").strip()
                if line.startswith("{") and '"listening"' in line:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("event") == "listening" and event.get("url"):
                        return str(event["url"])
    except OSError:
        return None
    return None


def _log_tail(path: str | None, lines: int = 3) -> str:
    if not path:
        return "no engine log"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return f"see {path}"
    return error_tail(text, lines) or f"see {path}"


# -- GPU telemetry during a point ----------------------------------------------------------------


class _GpuWatch:
    """Samples the point's GPUs while it runs (nothing on a machine without NVML GPUs)."""

    def __init__(self, ctx, point_id: int, gpus: tuple[int, ...]) -> None:
        self.ctx, self.point_id, self.gpus = ctx, point_id, list(gpus)
        self.stop_event = threading.Event()
        self.thread = None
        self.db = None

    def __enter__(self) -> _GpuWatch:
        from ddtree.engine.hw import nvml
        from ddtree.engine.sampler import Sampler, SamplerConfig

        session = nvml()
        if session.start() is None and session.count > 0:
            self.db = open_db(self.ctx.db_path)
            self.thread = Sampler(SamplerConfig(rate_hz=2.0), session=session).start(
                self.stop_event, db=self.db, labels={"job_id": self.ctx.job_id, "point_id": self.point_id})
        self.t0 = time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.db.close()

    def means(self) -> tuple[float | None, float | None]:
        if self.thread is None:
            return None, None
        return sweeps.telemetry_means(self.ctx.db, self.t0, time.time(), self.gpus or None)


# -- the loop ------------------------------------------------------------------------------------


def _planned_rows(plan: Plan) -> list[dict]:
    sweep = plan.recipe.sweep
    return [{**p.params(), "point_key": p.key, "idx": p.index, "baseline": p.baseline,
             "num_prompts": sweep.num_prompts, "max_new_tokens": sweep.max_new_tokens,
             "block_size": plan.recipe.engine.block_size} for p in plan.points]


def _open_run(ctx, spec: dict) -> tuple[int, Recipe]:
    db = ctx.db
    if "run_id" in spec:
        run = sweeps.get_run(db, spec["run_id"])
        try:
            recipe = recipe_from_dict(run.recipe)
        except RecipeError as exc:
            raise SweepSpecError(f"run {run.id} holds a recipe this version cannot read: {exc}") from None
        sweeps.update_run(db, run.id, job_id=ctx.job_id, state="running", ended_at=None, error=None)
        reset = sweeps.reset_interrupted(db, run.id)
        if reset:
            ctx.log(f"run {run.id}: {reset} point(s) interrupted earlier will run again")
        if not run.hardware:
            sweeps.update_run(db, run.id, hardware=hardware_fingerprint(str(ctx.data_dir)),
                              software=software_versions(recipe.engine.python))
        return run.id, recipe
    recipe = recipe_from_dict(spec["recipe"])
    run_id = sweeps.create_run(
        db, job_id=ctx.job_id, name=recipe.name, recipe=recipe_to_dict(recipe), recipe_path=spec.get("recipe_path"),
        recipe_git_rev=spec.get("recipe_git_rev"), engine_kind=recipe.engine.kind, model=recipe.engine.model,
        draft_model=recipe.engine.draft_model, hardware=hardware_fingerprint(str(ctx.data_dir)),
        software=software_versions(recipe.engine.python))
    return run_id, recipe


def run(ctx, spec: dict) -> dict:
    run_id, recipe = _open_run(ctx, spec)
    ctx.log(f"sweep run {run_id} ({recipe.name!r})")
    try:
        check_supported(recipe)
        result = _sweep(ctx, run_id, recipe)
    except JobCancelled:
        sweeps.finish_run(ctx.db, run_id, "cancelled")
        raise
    except BaseException as exc:
        sweeps.finish_run(ctx.db, run_id, "failed", error=str(exc) or type(exc).__name__)
        raise
    state = "succeeded" if result["points_done"] or not result["points_failed"] else "failed"
    # When no point ran, the engine's start-up failure is the cause worth showing on the job row.
    first = result["engine_failures"][0] if result["engine_failures"] else None
    if first is None and result["points_failed"]:
        # Points that failed one by one (requests refused, the engine died mid-point): the first one's cause.
        first = next((p.error for p in sweeps.list_points(ctx.db, run_id) if p.state == "failed" and p.error), None)
    error = f"all {result['points_failed']} point(s) failed" + (f"; {first}" if first else "")
    sweeps.finish_run(ctx.db, run_id, state, error=None if state == "succeeded" else error[:1000])
    if state == "failed":
        raise JobError(f"sweep run {run_id}: every point failed" + (f"; {first}" if first else ""),
                       f"see `ddtree-console export {run_id} --format md` and the job log for the causes")
    return result


def _sweep(ctx, run_id: int, recipe: Recipe) -> dict:
    db = ctx.db
    plan = make_plan(recipe, hardware=Hardware.detect(), cache_dir=ctx.data_dir)
    if plan.caps is not None:
        ctx.log(f"engine: {plan.caps.label} at {plan.caps.python}")
    for warning in plan.warnings:
        ctx.log(f"warning: {warning}")
    ctx.log(box_line(plan.box))  # the machine before the first point; each point records its own
    ctx.log(repeat_note(recipe))
    ids = sweeps.ensure_points(db, run_id, _planned_rows(plan))
    sweeps.update_run(db, run_id, points_total=len(plan.points))
    states = {p.point_key: p.state for p in sweeps.list_points(db, run_id)}
    todo = [p for p in plan.points if states.get(p.key) not in sweeps.FINISHED_POINT_STATES]
    finished = len(plan.points) - len(todo)
    if finished:
        ctx.log(f"run {run_id}: {finished} of {len(plan.points)} point(s) already finished; skipping them")
    ctx.progress(done=finished, total=len(plan.points), message=f"run {run_id}: starting")
    counts = {"done": 0, "failed": 0, "skipped": 0, "restarts": 0}
    saturated: dict[tuple, str] = {}
    causes: list[str] = []

    def fail_rest(rest: list[PlanPoint], message: str) -> None:
        nonlocal finished
        ctx.log(message)
        causes.append(message)
        for p in rest:
            sweeps.mark_point(db, ids[p.key], "failed", error=message)
            counts["failed"] += 1
            finished += 1
        ctx.progress(done=finished, message=f"run {run_id}: {message}"[:300])

    for launch_index, group in groupby(todo, key=lambda p: p.launch):
        launch = plan.launches[launch_index]
        points = list(group)
        if launch.unsupported is not None:
            fail_rest(points, f"cannot start the engine: {launch.unsupported}")
            continue
        engine: EngineProcess | None = None
        attempt = 0
        try:
            for point in points:
                ctx.check_cancelled()
                point_id = ids[point.key]
                cause = saturated.get(point.series)
                if cause is not None:
                    sweeps.mark_point(db, point_id, "skipped", error=cause)
                    counts["skipped"] += 1
                    finished += 1
                    continue
                if engine is None or engine.exited():
                    if engine is not None:
                        engine.stop()
                        engine = None
                        counts["restarts"] += 1
                    ctx.progress(message=f"run {run_id}: starting engine {launch.index}")
                    try:
                        engine, attempt = start_engine(ctx, plan, launch, attempt)
                    except (EngineError, JobError) as exc:
                        if isinstance(exc, JobCancelled):
                            raise
                        fail_rest(points[points.index(point):], f"engine failed to start: {exc}")
                        break
                state = _run_one(ctx, plan, point, point_id, engine, saturated)
                counts[state] += 1
                finished += 1
                sweeps.update_derived(db, run_id, unstable_spread=recipe.sweep.unstable_spread)
                ctx.progress(done=finished, message=f"run {run_id}: point {point.index + 1}/{len(plan.points)} {state}")
        finally:
            if engine is not None:
                engine.stop()
    return {"run_id": run_id, "points_total": len(plan.points), "points_done": counts["done"],
            "points_failed": counts["failed"], "points_skipped": counts["skipped"],
            "engine_restarts": counts["restarts"], "engine_failures": causes[:5]}


def _run_one(ctx, plan: Plan, point: PlanPoint, point_id: int, engine: EngineProcess,
             saturated: dict[tuple, str]) -> str:
    recipe, sweep = plan.recipe, plan.recipe.sweep
    db = ctx.db
    budget = "" if point.budget is None else f" budget={point.budget}"  # AR and DFlash have none
    label = (f"point {point.index + 1}/{len(plan.points)}: {point.algorithm}{budget} "
             f"c={point.concurrency} T={point.temperature:g} {point.dataset} r{point.repeat}")
    started = time.time()
    sweeps.mark_point(db, point_id, "running", started_at=started)
    ctx.progress(message=f"{label} running")
    try:
        prompts = load_prompts(point.dataset, sweep.num_prompts, seed=sweep.seed)
        warm = load_prompts(point.dataset, sweep.warmup, seed=sweep.seed, offset=sweep.num_prompts) \
            if sweep.warmup else []
    except EngineError as exc:
        sweeps.record_point(db, point_id, state="failed", metrics={}, requests=[], error=str(exc), started_at=started)
        ctx.log(f"{label} failed: {exc}")
        return "failed"
    speculative = None
    if recipe.engine.per_request_spec:
        speculative = {"algorithm": point.algorithm}
        if point.budget is not None:
            speculative["budget"] = point.budget
    # Warm-up runs on its own, before the first scrape, so the counter difference covers the
    # measured requests only.
    cfg = BenchConfig(concurrency=point.concurrency, max_new_tokens=sweep.max_new_tokens,
                      temperature=point.temperature, api=recipe.engine.request_api, request_rate=sweep.request_rate,
                      warmup=0, timeout_s=sweep.timeout_s, seed=sweep.seed, speculative=speculative,
                      model=recipe.engine.model)
    metrics_path = engine.spec.metrics_path if engine.spec is not None else "/metrics"
    warnings: list[str] = []
    with _GpuWatch(ctx, point_id, point.gpus) as gpu:
        if warm:
            warm_cfg = dataclasses.replace(cfg, request_rate=None, concurrency=max(1, min(cfg.concurrency, len(warm))))
            warmed = run_point(engine.url, warm, warm_cfg, stop=ctx.cancelled)
            if not any(r.ok for r in warmed.requests) and warmed.requests:
                first = warmed.requests[0]
                warnings.append(f"every warm-up request failed ({first.error}: {first.detail})")
        before = _scrape(engine.url, metrics_path) if not ctx.cancelled.is_set() else None
        box = Watch(our_pgids=(engine.proc.pid,) if engine.proc is not None else (), gpus=tuple(point.gpus))
        with box:
            result = run_point(engine.url, prompts, cfg, stop=ctx.cancelled)
        after = _scrape_settled(engine.url, metrics_path, before, result.metrics["requests_ok"])
        util, power = gpu.means()
    if ctx.cancelled.is_set():
        # An interrupted point is not a result: it goes back to pending for a resume.
        sweeps.mark_point(db, point_id, "pending")
        ctx.check_cancelled()
    counters = _counter_acceptance(engine, before, after, warnings)
    metrics = dict(result.metrics, gpu_util_mean=util, gpu_power_mean=power)
    state, error = _judge(result, engine)
    # The point, its requests and its counter figures in one transaction.
    with sweeps._write(db, f"point {point_id}") as tx:
        sweeps.record_point(tx, point_id, state=state, metrics=metrics, requests=_request_rows(result), error=error,
                            warnings=warnings + result.warnings, started_at=started)
        tx.execute("UPDATE points SET tau_counters = ?, accept_counters = ? WHERE id = ?",
                   [counters.tau if counters else None,
                    json.dumps(counters.to_dict()) if counters else None, point_id])
    busy = busy_reasons(box.reading)
    record_contention(db, point_id, box.reading.to_dict(), busy)
    if busy:
        ctx.log(f"{label}: warning: {busy_note(busy)}")
    summary = (f"{label} {state}: {metrics['requests_ok']} ok, {metrics['requests_failed']} failed, "
               f"{_fmt(metrics.get('output_tok_s'))} tok/s, tau {_fmt(metrics.get('tau_weighted'))}"
               f" (counters {_fmt(counters.tau if counters else None)})")
    ctx.log(summary + (f" ({error})" if error else ""))
    cause = _saturation(metrics, sweep)
    if cause is not None:
        saturated[point.series] = f"skipped: saturated at concurrency {point.concurrency} ({cause})"
        ctx.log(f"{label}: saturated ({cause}); higher concurrencies of this series are skipped")
    return state


def _scrape(url: str, path: str | None) -> Scrape | None:
    if not path:
        return None
    try:
        return fetch_scrape(url, path=path)
    except MetricsError:
        return None  # not exported (an engine without metrics): per-request figures only


def _scrape_settled(url: str, path: str | None, before: Scrape | None, requests_ok: int) -> Scrape | None:
    """The scrape after a point, once the server's request counter has counted the point's
    successful requests (or COUNTER_SETTLE_S passed; engines without that counter: at once)."""
    if before is None:
        return None
    deadline = time.monotonic() + COUNTER_SETTLE_S
    while True:
        after = _scrape(url, path)
        if after is None:
            return None
        now, then = after.total(SGLANG_REQUESTS), before.total(SGLANG_REQUESTS)
        if now is None or then is None or now - then >= requests_ok or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def _counter_acceptance(engine: EngineProcess, before: Scrape | None, after: Scrape | None,
                        warnings: list[str]) -> RunAcceptance | None:
    if before is None or after is None:
        return None
    kind = engine.spec.kind if engine.spec is not None else engine.recipe.engine.kind
    counters = run_acceptance(kind, before, after)
    if counters.counter_reset:
        warnings.append("the engine's counters went down during the point (it restarted): no counter figures")
        return None
    return counters


def _judge(result: PointResult, engine: EngineProcess) -> tuple[str, str | None]:
    gone = engine.died_reason()
    failures = result.metrics.get("failures") or {}
    if gone:
        return "failed", f"engine died during the point ({gone})"[:500]
    if result.metrics["requests_ok"] == 0:
        first = next((r for r in result.requests if r.error), None)
        detail = f": {first.detail}" if first is not None and first.detail else ""
        causes = ", ".join(f"{k} x{v}" for k, v in failures.items()) or "no requests ran"
        return "failed", f"every request failed ({causes}){detail}"[:500]
    return "done", None


def _saturation(metrics: dict, sweep) -> str | None:
    total = metrics["requests_ok"] + metrics["requests_failed"]
    if total and metrics["requests_failed"] / total > sweep.stop_error_rate:
        return f"error rate {metrics['requests_failed'] / total:.0%} > {sweep.stop_error_rate:.0%}"
    p99 = metrics.get("e2e_p99")
    if sweep.stop_e2e_p99_s is not None and p99 is not None and p99 > sweep.stop_e2e_p99_s:
        return f"p99 E2E {p99:.2f}s > {sweep.stop_e2e_p99_s:g}s"
    return None


def _request_rows(result: PointResult) -> list[dict]:
    return [{"idx": r.index, "ok": r.ok, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "ttft_s": r.ttft_s, "itl_mean_s": r.itl_mean_s, "e2e_s": r.e2e_s, "verify_ct": r.verify_ct,
             "accept_length": r.accept_length, "started_at": r.started_at, "error": r.error,
             "finish_reason": r.finish_reason, "detail": r.detail, "accept_hist": r.accept_hist}
            for r in result.requests]


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"
