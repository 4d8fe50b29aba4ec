"""Fixtures: a prompts file and a recipe writer for sweeps on the tiny random pair (the `tiny_pair`
and `server` fixtures are tests/conftest.py's). The demo pair is not needed (nor faster) for these."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(12)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_recipe(path: Path, tiny_pair, prompts_file: Path, **sweep) -> Path:
    """A builtin-engine recipe on the tiny pair; `sweep` overrides [sweep] keys."""
    target, drafter = tiny_pair
    table = {"budget": [2, 6], "concurrency": [1, 2], "dataset": str(prompts_file), "num_prompts": 4,
             "max_new_tokens": 8, "warmup": 1, "baseline": ["ar"], "timeout_s": 60.0, **sweep}

    def value(v):
        return json.dumps(v)

    lines = ['name = "tiny"', "[engine]", 'kind = "builtin"', f"model = {value(str(target))}",
             f"draft_model = {value(str(drafter))}", "ready_timeout_s = 120.0", "[sweep]"]
    lines += [f"{k} = {value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def finished_run(db_path, *, done: bool) -> tuple[int, int]:
    """A two-point run on the demo pair whose job succeeded, every point done (or, done=False, none
    measured and the job cancelled); (run id, job id)."""
    from ddtree.jobs.kinds.sweep import _planned_rows
    from ddtree.jobs.model import create_job, set_state
    from ddtree.jobs.plan import make_plan
    from ddtree.jobs.recipe import parse_recipe, recipe_to_dict
    from ddtree.store import open_db, sweeps

    recipe = parse_recipe('name = "r"\n[sweep]\nbudget = [4]\nconcurrency = [1, 2]\n')
    plan = make_plan(recipe)
    with open_db(db_path) as db:
        job_id = create_job(db, "sweep", {"run_id": 1}, name="r")
        for state in ("starting", "running", "succeeded" if done else "cancelled"):
            set_state(db, job_id, state)
        run_id = sweeps.create_run(db, job_id=job_id, name="r", recipe=recipe_to_dict(recipe), engine_kind="builtin",
                                   points_total=len(plan.points))
        for point_id in sweeps.ensure_points(db, run_id, _planned_rows(plan)).values():
            if done:
                sweeps.mark_point(db, point_id, "done")
        sweeps.finish_run(db, run_id, "succeeded" if done else "cancelled")
    return run_id, job_id

