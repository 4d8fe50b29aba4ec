"""`ddtree-console sweep`: run a recipe's grid as a job, show its plan, or resume a run.

    sweep RECIPE.toml [--detach] [--dry-run [--no-probe]] [--json] [--name NAME]
    sweep --resume RUN_ID [--detach] [--json]
    sweep --settle RUN_ID [--detach] [--dry-run] [--json]

For kind sglang/vllm the dry run shows each launch exactly as it will be typed (env, argv), built
from the flags the recipe's interpreter accepts; a launch it cannot build is shown with the reason
and makes a real run exit 2 before anything starts. `--dry-run --no-probe` runs no interpreter,
and a prompt file that is not on this machine is a warning there, not a refusal.

The checks, the run row and the job come from `jobs.start.start_sweep`, which the console's sweep
form calls too (so both refuse the same recipes); `--resume` submits a new job for the same run,
which skips the points already finished; `--settle` starts a new run of the cells that keep a run's
budget recommendation undecided, with the repeats the recommender asks for (jobs/settle.py).
In the foreground a line is printed per finished point; Ctrl-C cancels the job (resume later).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from pathlib import Path

from ddtree.console.commands import UsageError, run_id
from ddtree.console.fmt import printable
from ddtree.jobs.plan import HARD_MAX_POINTS, MAX_POINTS, format_plan
from ddtree.jobs.recipe import load_recipe
from ddtree.jobs.start import plan_sweep, start_sweep, submit_sweep
from ddtree.store import sweeps
from ddtree.store.db import data_dir, existing_store, open_db, open_existing, resolve_db_path
from ddtree.store.records import ACTIVE_STATES


class SweepUsageError(UsageError):
    """A sweep command line that cannot start: neither a recipe nor --resume (or both), options that
    do not go together, or a run another job is still running."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sweep", help="run a benchmark sweep from a recipe (or show its plan, or resume a run)",
        description="Run the grid of a recipe (TOML) against an engine as a job that outlives this terminal, "
                    "filling the store point by point. --dry-run prints every engine launch and point with an "
                    "estimated duration and starts no server and writes no run; for an sglang/vllm recipe it runs "
                    "the recipe's interpreter once to read its version and flags (cached beside the database), "
                    "unless --no-probe. A prompt file that is not on this machine is refused, except in a dry run "
                    "with --no-probe, which warns of it once (it may be on the machine that runs the sweep).")
    p.add_argument("recipe", nargs="?", help="the recipe file (TOML), e.g. assets/recipes/demo.toml")
    p.add_argument("--resume", type=run_id, metavar="RUN_ID", help="resume a run: skip its finished points")
    p.add_argument("--settle", type=run_id, metavar="RUN_ID",
                   help="a new run of the budgets that keep RUN_ID's recommendation undecided, with the repeats "
                        "that would decide it (see `ddtree-console runs`)")
    p.add_argument("--detach", action="store_true", help="run in the background and return at once")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and exit; no server starts (sglang/vllm: the interpreter is probed)")
    p.add_argument("--no-probe", action="store_true",
                   help="with --dry-run: do not run the recipe's sglang/vllm interpreter (no launch commands then), "
                        "and warn of a prompt file that is not on this machine instead of refusing it")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--yes-large", action="store_true",
                   help=f"run a grid of more than {MAX_POINTS:,} points (refused without it; "
                        f"more than {HARD_MAX_POINTS:,} is refused even with it)")
    p.add_argument("--name", help="name of the run and its job (default: the recipe's name; a resumed run keeps its own)")
    p.set_defaults(command_module=__name__)


def run(args: argparse.Namespace) -> int:
    settle = getattr(args, "settle", None)
    if [args.recipe is not None, args.resume is not None, settle is not None].count(True) != 1:
        raise SweepUsageError("give one of a recipe file, --resume RUN_ID or --settle RUN_ID",
                              "e.g. `ddtree-console sweep assets/recipes/demo.toml`")
    if args.name is not None and not args.name.strip():
        raise SweepUsageError("--name is empty", "leave --name out to keep the recipe's (or the run's) name")
    if args.detach and args.dry_run:
        raise SweepUsageError("--detach does nothing with --dry-run", "a dry run starts nothing to detach from")
    if getattr(args, "no_probe", False) and not args.dry_run:
        raise SweepUsageError("--no-probe applies to --dry-run only", "a sweep needs the probe to build its commands")
    if args.resume is not None:
        if args.dry_run:
            raise SweepUsageError("--dry-run applies to a recipe file, not to --resume")
        return _resume(args)
    db_path = resolve_db_path(getattr(args, "db", None))
    recipe = load_recipe(args.recipe) if settle is None else _settle_recipe(getattr(args, "db", None), settle)
    if args.dry_run:
        if args.name is not None:
            # the plan is headed by the name the run would get, and a real start gives it --name
            recipe = dataclasses.replace(recipe, name=args.name)
        planned = plan_sweep(recipe, cache_dir=data_dir(db_path), allow_large=args.yes_large,
                             probe=not getattr(args, "no_probe", False), check=False)
        print(json.dumps(planned.plan.to_dict(), indent=2) if args.json else format_plan(planned.plan))
        return 0
    printer = _PointPrinter(db_path, quiet=args.json)
    try:
        started = start_sweep(db_path, recipe, recipe_path=args.recipe, name=args.name, allow_large=args.yes_large,
                              detach=args.detach, on_run=None if args.detach else printer.start)
    finally:
        printer.stop()
    return _report(args, db_path, started.run_id, started.job_id)


def _settle_recipe(db_path: str | None, run: int):
    from ddtree.jobs.settle import settle_recipe

    with open_existing(db_path) as db:
        return settle_recipe(sweeps.get_run(db, run), sweeps.list_points(db, run))


def _resume(args: argparse.Namespace) -> int:
    from ddtree.jobs.kinds.sweep import close_finished, nothing_to_resume
    from ddtree.jobs.procs import is_alive
    from ddtree.jobs.supervisor import reconcile
    from ddtree.store.queries import get_job

    db_path = existing_store(getattr(args, "db", None))
    db = open_db(db_path)
    try:
        run = sweeps.get_run(db, args.resume)
        if run.job_id is not None:
            job = get_job(db, run.job_id)
            if job.state in ACTIVE_STATES:
                if job.pid is None or is_alive(job.pid, job.pid_started):
                    raise SweepUsageError(f"run {run.id} is still being run by job {job.id} ({job.state})",
                                          f"cancel it first with `ddtree-console jobs cancel {job.id}`")
                # Its runner is gone: mark it lost (and stop what it left running) before taking over.
                reconcile(db_path, stale_s=0.0)
        points = sweeps.list_points(db, run.id)
        if nothing_to_resume(points):
            close_finished(db, sweeps.get_run(db, run.id))
    finally:
        db.close()
    if nothing_to_resume(points):
        if args.json:
            print(json.dumps({"job_id": None, "run_id": run.id, "state": None, "points": _counts(points),
                              "nothing_to_resume": True}))
        else:
            print(f"run {run.id}: all {len(points)} points are finished; nothing to resume")
        return 0
    return _start(args, db_path, run.id, args.name or run.name or f"run-{run.id}")


def _start(args: argparse.Namespace, db_path: Path, run_id: int, name: str) -> int:
    """Submit the job for an existing run (a resume) and report as for a new one."""
    printer = _PointPrinter(db_path, quiet=args.json)
    try:
        if not args.detach:
            printer.start(run_id)
        job_id = submit_sweep(db_path, run_id, name, detach=args.detach)
    finally:
        printer.stop()
    return _report(args, db_path, run_id, job_id)


def _counts(points: list) -> dict[str, int]:
    """How many of a run's points are in each state (every state, zeros included)."""
    return {state: sum(1 for p in points if p.state == state) for state in sweeps.POINT_STATES}


def _report(args: argparse.Namespace, db_path: Path, run_id: int, job_id: int) -> int:
    from ddtree.store.queries import get_job

    if args.detach:
        if args.json:
            print(json.dumps({"job_id": job_id, "run_id": run_id}))
        else:
            print(f"sweep run {run_id} started as job {job_id}; follow it with "
                  f"`ddtree-console jobs logs {job_id} --follow`, resume with `ddtree-console sweep --resume {run_id}`")
        return 0
    db = open_db(db_path)
    try:
        job = get_job(db, job_id)
        points = sweeps.list_points(db, run_id)
    finally:
        db.close()
    counts = _counts(points)
    if args.json:
        print(json.dumps({"job_id": job_id, "run_id": run_id, "state": job.state, "points": counts}))
    else:
        print(f"run {run_id} {job.state}: {counts['done']} done, {counts['failed']} failed, "
              f"{counts['skipped']} skipped, {counts['pending'] + counts['running']} left"
              + (f"; resume with `ddtree-console sweep --resume {run_id}`" if counts['pending'] + counts['running'] else ""))
        if job.state not in ("succeeded", "cancelled") and getattr(job, "error", None):
            print(f"error: {printable(job.error)}", file=sys.stderr)
        elif counts["failed"]:
            # Some points failed but the run went on: say why the first one did, not only how many.
            first = next((p.error for p in points if p.state == "failed" and p.error), None)
            if first:
                print(f"first error: {printable(first)}", file=sys.stderr)
    if job.state == "cancelled":
        return 130  # Ctrl-C: the shell's code for an interrupt, as `download` returns; not a failure
    return 0 if job.state == "succeeded" else 1


class _PointPrinter:
    """Prints a line for each point of the run that finishes, from its own connection."""

    def __init__(self, db_path: Path, *, quiet: bool = False) -> None:
        self.db_path, self.quiet = db_path, quiet
        self.run_id: int | None = None
        self.done = threading.Event()
        self.seen: set[int] = set()
        self.thread = threading.Thread(target=self._loop, name="sweep-progress", daemon=True)

    def start(self, run_id: int) -> None:
        self.run_id = run_id
        db = open_db(self.db_path)
        try:
            self.seen = {p.id for p in sweeps.list_points(db, self.run_id) if p.state in ("done", "failed", "skipped")}
        finally:
            db.close()
        if not self.quiet:
            self.thread.start()

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
            self._poll()

    def _loop(self) -> None:
        while not self.done.wait(0.5):
            self._poll()

    def _poll(self) -> None:
        db = open_db(self.db_path)
        try:
            points = sweeps.list_points(db, self.run_id)
        finally:
            db.close()
        total = len(points)
        for p in points:
            if p.id in self.seen or p.state not in ("done", "failed", "skipped"):
                continue
            self.seen.add(p.id)
            print(f"[{len(self.seen)}/{total}] {printable(format_point(p))}", flush=True)


def format_point(p: sweeps.Point) -> str:
    budget = "" if p.budget is None else f" budget={p.budget}"
    head = f"{p.algorithm}{budget} c={p.concurrency} T={p.temperature:g} {p.dataset} r{p.repeat}: {p.state}"
    if p.state != "done":
        return f"{head} ({p.error})" if p.error else head

    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    parts = [f"{num(p.output_tok_s, '.1f')} tok/s", f"tau {num(p.tau_weighted, '.2f')}",
             f"ttft p50 {num(p.ttft_p50, '.3f')}s", f"e2e p99 {num(p.e2e_p99, '.2f')}s"]
    if p.speedup_vs_ar is not None and p.algorithm != "ar":
        parts.append(f"x{p.speedup_vs_ar:.2f} vs ar")
    if p.requests_failed:
        parts.append(f"{p.requests_failed} failed")
    return f"{head}  " + "  ".join(parts)
