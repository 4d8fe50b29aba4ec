"""Starting a sweep: the one path from a recipe to a queued run and its job, for the CLI and the console.

    plan_sweep(recipe, *, cache_dir=None, allow_large=False, probe=True, check=True) -> PlannedSweep
    start_sweep(db_path, recipe, *, recipe_path=None, name=None, allow_large=False, detach=True,
                on_run=None) -> StartedSweep
    submit_sweep(db_path, run_id, name, *, secrets=None, detach=True) -> int
    git_revision(path) -> str | None

`ddtree-console sweep` and the console's sweep form both call `start_sweep`, so a recipe one of
them refuses (a prompt file that is not there, a launch that cannot be built, a grid too large) the
other refuses too, with the same one-line error and before anything is written to the store.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.jobs.plan import Hardware, Plan, check_datasets, check_plan, check_size, make_plan
from ddtree.jobs.recipe import Recipe, recipe_from_dict, recipe_to_dict
from ddtree.store.db import data_dir, open_db, resolve_db_path
from ddtree.store.redact import redact, secret_env


@dataclass(frozen=True)
class PlannedSweep:
    """The plan of a recipe ready to store (local paths absolute, secret values redacted) and the
    real secret values, which go to the runner's environment only."""

    plan: Plan
    secrets: Mapping[str, str] = field(default_factory=dict)

    @property
    def recipe(self) -> Recipe:
        return self.plan.recipe


@dataclass(frozen=True)
class StartedSweep:
    run_id: int
    job_id: int
    name: str


def absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe with its local paths (prompt files, model folders, interpreter) made absolute,
    taken from the folder the sweep starts in: the run stores the recipe, and a detached runner or a
    later --resume may start elsewhere (where `models/x` would even read as a hub repo id)."""

    def local(text: str | None, *, dataset: bool = False) -> str | None:
        if text is None or text.startswith("builtin:"):
            return text
        if dataset and not (text.endswith(".jsonl") or os.sep in text):
            return text  # a dataset name, looked up in the dataset folders
        path = Path(text).expanduser()
        return str(path.resolve()) if not path.is_absolute() and path.exists() else text

    engine = dataclasses.replace(recipe.engine, python=local(recipe.engine.python), model=local(recipe.engine.model),
                                 draft_model=local(recipe.engine.draft_model))
    sweep = dataclasses.replace(recipe.sweep, dataset=tuple(local(d, dataset=True) for d in recipe.sweep.dataset))
    return dataclasses.replace(recipe, engine=engine, sweep=sweep)


def plan_sweep(recipe: Recipe, *, cache_dir: str | os.PathLike | None = None, allow_large: bool = False,
               probe: bool = True, check: bool = True,
               detect: Callable[[], Hardware] | None = None) -> PlannedSweep:
    """Paths made absolute, secrets split off, the grid's size checked, and the plan made with this
    machine's hardware (sglang/vllm: placed on its GPUs, the interpreter probed and cached under
    `cache_dir` unless probe=False). check=False is the dry run: a plan whose launches would be
    refused is returned to be shown, with its warnings; check=True raises the refusal (exit 2). A
    grid too large or a prompt set that cannot be read is refused either way, except that the dry
    run with probe=False (`--dry-run --no-probe`: nothing of this machine is checked) only warns,
    in the plan, of a prompt file that is not here (it may be on the machine that runs the sweep)."""
    from ddtree.jobs.kinds.sweep import check_supported

    recipe = absolute_paths(recipe)
    # From here on the recipe's secret env values read <redacted> (the dry run, the stored run, the
    # logs); the real ones go to the runner's environment only.
    secrets = secret_env(recipe_to_dict(recipe))
    recipe = recipe_from_dict(redact(recipe_to_dict(recipe)))
    check_size(recipe, allow_large=allow_large)
    check_datasets(recipe, missing_ok=not probe and not check)
    if check:
        check_supported(recipe)
    # looked up per call, not bound at import, so a stand-in Hardware.detect is seen
    hardware = (detect or Hardware.detect)() if recipe.engine.kind != "builtin" else None
    plan = make_plan(recipe, hardware=hardware, cache_dir=cache_dir, probe=probe)
    if check:
        check_plan(plan)
    return PlannedSweep(plan=plan, secrets=secrets)


def start_sweep(db_path: str | os.PathLike | None, recipe: Recipe, *, recipe_path: str | os.PathLike | None = None,
                name: str | None = None, allow_large: bool = False, detach: bool = True,
                on_run: Callable[[int], None] | None = None,
                detect: Callable[[], Hardware] | None = None) -> StartedSweep:
    """Plan and check `recipe` (see `plan_sweep`), then create its run (queued) and submit the job
    that runs it. Nothing is written before every check passed. `on_run(run_id)` is called once the
    run exists and before the job starts (the CLI's foreground progress lines start there);
    detach=False runs the job in this process and returns when it ended."""
    path = resolve_db_path(db_path)
    planned = plan_sweep(recipe, cache_dir=data_dir(path), allow_large=allow_large, detect=detect)
    recipe = planned.recipe
    name = name or recipe.name
    source = str(Path(recipe_path).expanduser().resolve()) if recipe_path is not None else None
    db = open_db(path)
    try:
        from ddtree.store import sweeps

        run_id = sweeps.create_run(
            db, job_id=None, name=name, recipe=recipe_to_dict(recipe), recipe_path=source,
            recipe_git_rev=git_revision(source) if source else None, engine_kind=recipe.engine.kind,
            model=recipe.engine.model, draft_model=recipe.engine.draft_model, points_total=len(planned.plan.points))
        sweeps.update_run(db, run_id, state="queued")
    finally:
        db.close()
    if on_run is not None:
        on_run(run_id)
    job_id = submit_sweep(path, run_id, name, secrets=dict(planned.secrets), detach=detach)
    return StartedSweep(run_id=run_id, job_id=job_id, name=name)


def submit_sweep(db_path: str | os.PathLike | None, run_id: int, name: str, *,
                 secrets: dict[str, str] | None = None, detach: bool = True) -> int:
    """The job that runs (or resumes) run `run_id`; its id. The run's stored recipe is redacted, so
    `secrets` carries the real values to the runner's environment."""
    from ddtree.jobs.supervisor import submit

    return submit(db_path, "sweep", {"run_id": run_id}, name=name, detach=detach, secrets=secrets)


def git_revision(path: str | os.PathLike) -> str | None:
    """The commit of the repository holding `path` ("<sha>+dirty" when the file has changes); None
    outside a repository or without git. A run records it beside its recipe file."""
    file = Path(path).resolve()
    try:
        head = subprocess.run(["git", "-C", str(file.parent), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, start_new_session=True, stdin=subprocess.DEVNULL)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(file.parent), "status", "--porcelain", "--", str(file)],
                               capture_output=True, text=True, timeout=10, start_new_session=True,
                               stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = head.stdout.strip()
    return f"{sha}+dirty" if dirty.stdout.strip() else sha
