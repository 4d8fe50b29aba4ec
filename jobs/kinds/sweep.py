"""The `sweep` job kind: run a recipe's grid against an engine and fill the store point by point.

Spec: `{"run_id": N}` runs (or resumes) a run row that already holds its recipe (the CLI creates
it); `{"recipe": {...}, "recipe_path": ..., "recipe_git_rev": ...}` creates the run first. Either
way the same loop follows: plan the grid, create the missing point rows, skip points already
`done` or `skipped`, and for each engine launch with work left start the engine, wait for /health,
run its points (jobs/point.py), stop it.

Engines (jobs/engine_process.py): the builtin server is started on port 0 and its listening line
is read from its log; SGLang and vLLM get the launch spec of jobs/plan.py rebuilt with a port free
at that moment, their GPUs checked first (they exist, nothing else holds them, the weights fit),
CPUs pinned to the GPUs' NUMA node (numactl or taskset in the command; with neither installed the
runner sets the child's CPU affinity right after it starts, long before it loads anything), and
/health polled up to the recipe's ready timeout. A start that fails is classified from the
engine's log (out of memory, NCCL, port in use, missing model files, unsupported flag ...) and
that reason is what the points, the engine row and the job carry; a port lost to a race is
retried once on a new port.

A point that fails (every request failed, the engine died) is recorded with its cause and the
sweep goes on; the engine is restarted for the next point if it died. A point whose error rate or
p99 latency crosses the recipe's limits marks the higher concurrencies of its series `skipped`.
The run row carries the software and hardware it ran on (jobs/fingerprint.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from itertools import groupby

from ddtree.engine.errors import EngineError
from ddtree.engine.machine.preflight import PreflightError, check_gpus, preflight
from ddtree.jobs.engine_process import EngineProcess, EngineStartFailed
from ddtree.jobs.errors import JobCancelled, JobError
from ddtree.jobs.fingerprint import hardware_fingerprint, software_versions
from ddtree.jobs.plan import Hardware, Launch, Plan, PlanPoint, UnsupportedEngine, box_line, make_plan, repeat_note
from ddtree.jobs.point import measure_point
from ddtree.jobs.recipe import Recipe, RecipeError, recipe_from_dict, recipe_to_dict
from ddtree.store import sweeps
from ddtree.engine.units import plural

# Our previous engine on the same GPUs has just exited; the driver may list it for a moment more.
GPU_BUSY_WAIT_S = 20.0
PORT_RETRIES = 1


class SweepSpecError(JobError):
    exit_code = 2


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


# -- the engine of a launch ----------------------------------------------------------------------


def start_engine(ctx, plan: Plan, launch: Launch, attempt: int) -> tuple[EngineProcess, int]:
    """Start `launch` and wait until it answers /health, retrying on a fresh port when the one
    chosen was taken in the meantime; (the running engine, the next attempt number). Raises
    EngineStartFailed (with the cause read from the engine's log), PreflightError or another EngineError."""
    recipe = plan.recipe
    for retry in range(PORT_RETRIES + 1):
        name = f"engine-{launch.index}-{attempt}"
        attempt += 1
        if launch.gpus:
            _check_launch_gpus(ctx, recipe, launch)
        spec = plan.launch_spec(launch)
        ctx.log(f"engine {name}: {spec.command_line()}")
        for note in spec.notes:
            ctx.log(f"engine {name}: note: {note}")
        engine = EngineProcess(ctx, spec, name=name, ready_timeout_s=recipe.engine.ready_timeout_s,
                               row=_engine_row(ctx, recipe, launch, spec))
        t0 = time.monotonic()
        try:
            engine.start()
            url = engine.wait_ready()
            ctx.log(f"engine {name} ready at {url} after {time.monotonic() - t0:.1f}s")
            return engine, attempt
        except EngineStartFailed as exc:
            engine.stop()
            if exc.code != "port_in_use" or launch.kind == "builtin" or retry == PORT_RETRIES:
                raise
            ctx.log(f"engine {name}: {exc}; retrying on another port")
        except BaseException:
            engine.stop()
            raise
    raise AssertionError("unreachable")


def _engine_row(ctx, recipe: Recipe, launch: Launch, spec) -> dict:
    """What the `engines` row says of this launch."""
    engine = recipe.engine
    return {"job_id": ctx.job_id, "kind": engine.kind, "model": engine.model or "demo",
            "draft_model": engine.draft_model or ("demo" if engine.model is None else None),
            "algorithm": launch.algorithm, "budget": launch.budget, "block_size": engine.block_size,
            "tp": launch.tp, "gpus": json.dumps(list(launch.gpus)), "python": engine.python or sys.executable,
            "extra_args": json.dumps(list(engine.extra_args)), "base_url": spec.base_url, "host": spec.host,
            "port": spec.port or None}


def _check_launch_gpus(ctx, recipe: Recipe, launch: Launch) -> None:
    """Right before a launch: its GPUs exist, nothing else holds them, and the weights fit.
    Raises PreflightError (the reason names the GPU or the sizes)."""
    from ddtree.engine.machine.hw import gpu_view

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
            ctx.log(f"run {run.id}: {plural(reset, 'point')} interrupted earlier will run again")
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


def nothing_to_resume(points: list) -> bool:
    """A run whose points are all finished (done or skipped): resuming it has nothing to run."""
    return bool(points) and all(p.state in sweeps.FINISHED_POINT_STATES for p in points)


def close_finished(db, run) -> None:
    """End a run whose points are all finished but which never ended (its runner died between its
    last point and the end), as that runner would have; a run that ended stays as it is."""
    if run.state != "succeeded":
        sweeps.finish_run(db, run.id, "succeeded")


def run(ctx, spec: dict) -> dict:
    if "run_id" in spec:
        found = sweeps.get_run(ctx.db, spec["run_id"])
        run_id = found.id
        points = sweeps.list_points(ctx.db, run_id)
        if nothing_to_resume(points):
            # Not taken over: that would make this job its job_id and mark it running, for no
            # point measured.
            close_finished(ctx.db, found)
            message = f"run {run_id}: all {plural(len(points), 'point')} are finished; nothing to resume"
            ctx.log(message)
            ctx.progress(done=len(points), total=len(points), message=message)
            return {"run_id": run_id, "points_total": len(points), "points_done": 0, "points_failed": 0,
                    "points_skipped": 0, "engine_restarts": 0, "engine_failures": [], "nothing_to_resume": True}
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
    error = f"all {plural(result['points_failed'], 'point')} failed" + (f"; {first}" if first else "")
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
        ctx.log(f"run {run_id}: {finished} of {plural(len(plan.points), 'point')} already finished; skipping them")
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
                state, skip = measure_point(ctx, plan, point, point_id, engine)
                if skip is not None:
                    saturated[point.series] = skip
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
