"""The follow-up sweep that settles an undecided budget recommendation (issue 20).

When the recommender (store/insight.py) cannot tell tied budgets apart, it names the cells to
measure again and how many repeats each needs. `settle_recipe` turns that into a recipe: the run's
own recipe, narrowed to the budgets and settings in question, with the baselines kept (the gains
over AR and DFlash are paired repeat by repeat) and `repeats` raised to the largest ask. Its run
shares the original's fingerprint, so History and the regression sentinel read the two together.
"""

from __future__ import annotations

import dataclasses

from ddtree.jobs.errors import JobError
from ddtree.jobs.recipe import Recipe, RecipeError, recipe_from_dict
from ddtree.store.insight import recommend


class NothingToSettle(JobError):
    """Every setting of the run already has a decided recommendation, or none was measured yet."""

    exit_code = 2


def settle_recipe(run_row, points: list) -> Recipe:
    """A recipe that measures again what keeps the run's recommendations undecided."""
    try:
        recipe = recipe_from_dict(run_row.recipe)
    except (RecipeError, TypeError) as exc:
        raise JobError(f"run {run_row.id} holds no readable recipe: {exc}") from None
    if not any(p.state == "done" for p in points):
        # recommend() has nothing to weigh then, which read as "every recommendation is decided"
        raise NothingToSettle(f"run {run_row.id} has nothing measured yet",
                              f"finish it first with `ddtree-console sweep --resume {run_row.id}`")
    open_recs = [rec for rec in recommend(points) if rec.more]
    if not open_recs:
        raise NothingToSettle(f"run {run_row.id} needs no more repeats: every recommendation is decided",
                              "`ddtree-console runs` shows them")
    budgets = sorted({ask.budget for rec in open_recs for ask in rec.more})
    concurrency = sorted({rec.setting["concurrency"] for rec in open_recs if rec.setting.get("concurrency")})
    repeats = max(ask.want for rec in open_recs for ask in rec.more)
    sweep = recipe.sweep
    sweep = dataclasses.replace(sweep, budget=tuple(budgets),
                                concurrency=tuple(concurrency) or sweep.concurrency,
                                repeats=max(repeats, sweep.repeats))
    return dataclasses.replace(recipe, name=f"{recipe.name}-settle", sweep=sweep)
