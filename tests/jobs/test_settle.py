"""The follow-up recipe that settles an undecided recommendation: narrowed to the tied budgets,
baselines kept, repeats raised to the largest ask; a decided run has nothing to settle."""

import pytest

from ddtree.jobs.recipe import recipe_from_dict
from ddtree.jobs.settle import NothingToSettle, settle_recipe
from ddtree.store import sweeps
from ddtree.store.db import open_db
from ddtree.store.insight import recommend

from ..console.test_export_verdict import CLEAR, TIED, _seed


def _run(db_path, rates):
    run_id = _seed(db_path, rates)
    with open_db(db_path) as db:
        return sweeps.get_run(db, run_id), sweeps.list_points(db, run_id)


def test_a_tie_becomes_a_recipe_for_the_tied_budgets_with_more_repeats(tmp_path):
    run, points = _run(tmp_path / "d.db", TIED)
    (rec,) = recommend(points)
    assert not rec.decided and rec.more
    recipe = settle_recipe(run, points)
    assert recipe.name == "repeats-settle"
    assert set(recipe.sweep.budget) == {ask.budget for ask in rec.more}
    assert recipe.sweep.repeats == max(ask.want for ask in rec.more) > 3
    assert recipe.sweep.baseline == ("ar",)
    assert recipe.engine == recipe_from_dict(run.recipe).engine


def test_a_decided_run_has_nothing_to_settle(tmp_path):
    run, points = _run(tmp_path / "d.db", CLEAR)
    with pytest.raises(NothingToSettle, match="needs no more repeats"):
        settle_recipe(run, points)


def test_sweep_settle_plans_the_follow_up_and_refuses_a_decided_run(tmp_path, capsys):
    import json

    from ddtree.console import cli

    tied = _seed(tmp_path / "t.db", TIED)
    assert cli.main(["--db", str(tmp_path / "t.db"), "sweep", "--settle", str(tied), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    budgets = {p["budget"] for p in plan["points"] if p["algorithm"] == "ddtree"}
    repeats = {p["repeat"] for p in plan["points"]}
    assert budgets and budgets <= {8, 16, 32} and len(repeats) > 3

    clear = _seed(tmp_path / "c.db", CLEAR)
    assert cli.main(["--db", str(tmp_path / "c.db"), "sweep", "--settle", str(clear)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run {clear} needs no more repeats") and err.count("\n") == 1


def test_a_run_with_nothing_measured_points_at_resume(tmp_path, capsys):
    from ddtree.console import cli

    from .sweep.conftest import finished_run

    run_id, _ = finished_run(tmp_path / "d.db", done=False)  # cancelled before its first point ended
    assert cli.main(["--db", str(tmp_path / "d.db"), "sweep", "--settle", str(run_id)]) == 2
    assert capsys.readouterr().err == (f"error: run {run_id} has nothing measured yet "
                                       f"(finish it first with `ddtree-console sweep --resume {run_id}`)\n")
