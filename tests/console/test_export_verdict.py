"""`runs` and the md/json exports on a store of known repeats: the verdict (best only when its
interval clears the runner-up's, else a tie naming the tied budgets), the unstable flag, the paired
ratios with their interval, and the tau labels."""

import argparse
import json
import sys

import pytest

from ddtree.console.commands import export, runs
from ddtree.jobs.plan import make_plan
from ddtree.jobs.recipe import parse_recipe, recipe_to_dict
from ddtree.store import sweeps
from ddtree.store.db import open_db

RECIPE = """
name = "repeats"
[engine]
model = "/nowhere/target"
draft_model = "/nowhere/drafter"
[sweep]
budget = [8, 16, 32]
baseline = ["ar"]
repeats = 3
num_prompts = 8
"""

#: output tok/s by (algorithm, budget) per repeat: 16 clears everything; 8 and 32 tie; 32 is unstable
CLEAR = {("ar", None): (50.0, 52.0, 48.0), ("ddtree", 8): (100.0, 102.0, 98.0),
         ("ddtree", 16): (150.0, 151.0, 149.0), ("ddtree", 32): (90.0, 120.0, 100.0)}
TIED = {**CLEAR, ("ddtree", 16): (101.0, 104.0, 99.0)}


def _seed(db_path, rates, text: str = RECIPE) -> int:
    recipe = parse_recipe(text)
    plan = make_plan(recipe)
    with open_db(db_path) as db:
        run_id = sweeps.create_run(db, job_id=None, name=recipe.name, recipe=recipe_to_dict(recipe),
                                   engine_kind="builtin", points_total=len(plan.points))
        rows = [{**p.params(), "point_key": p.key, "idx": p.index, "baseline": p.baseline} for p in plan.points]
        ids = sweeps.ensure_points(db, run_id, rows)
        for p in plan.points:
            tok_s = rates[(p.algorithm, p.budget)][p.repeat]
            metrics = {"requests_ok": 8, "requests_failed": 0, "output_tokens": 800, "duration_s": 800 / tok_s,
                       "output_tok_s": tok_s, "tau_weighted": 3.0, "tau_mean": 2.8}
            sweeps.record_point(db, ids[p.key], state="done", metrics=metrics, requests=[])
        sweeps.update_derived(db, run_id, unstable_spread=recipe.sweep.unstable_spread)
    return run_id


def _export(db_path, run_id, fmt, capsys) -> str:
    assert export.run(argparse.Namespace(db=str(db_path), run_id=run_id, format=fmt, output=None)) == 0
    return capsys.readouterr().out


def test_a_clear_winner_is_called_best_everywhere(tmp_path, capsys):
    db_path = tmp_path / "d.db"
    run_id = _seed(db_path, CLEAR)
    md = _export(db_path, run_id, "md", capsys)
    # the runner-up by mean is 32 (103.3), whose wide interval 16's still clears
    assert ("- c=1: best budget 16 at 150.0 tok/s (95% CI 147.5-152.5, clear of budget 32) "
            "(3.00x [2.76-3.26] AR); unstable (CV > 10%): budgets 32") in md  # paired: 150/50, 151/52, 149/48
    assert "tau (weighted by verify)" in md and "tau (mean of requests)" in md
    assert "unstable (CV 15% > 10%)" in md  # budget 32: 90, 120, 100 (sd 15.3, mean 103.3)
    data = json.loads(_export(db_path, run_id, "json", capsys))
    best = data["best_budget"][0]
    assert best["state"] == "best" and best["best"] == 16 and best["unstable"] == [32]
    row = next(r for r in data["summary"] if r["budget"] == 16)
    assert row["output_tok_s_stats"]["n"] == 3 and row["output_tok_s_stats"]["mean"] == pytest.approx(150.0)
    assert row["vs_ar"]["n"] == 3 and row["vs_ar"]["ci_low"] < 3.0 < row["vs_ar"]["ci_high"]
    assert "tau_weighted" in data["metrics"]
    assert runs.run(argparse.Namespace(db=str(db_path), json=False, filter=None, limit=None)) == 0
    assert "best 16 unstable" in capsys.readouterr().out


def test_overlapping_intervals_are_a_tie_naming_the_budgets(tmp_path, capsys):
    db_path = tmp_path / "d.db"
    run_id = _seed(db_path, TIED)
    md = _export(db_path, run_id, "md", capsys)
    assert "tie within noise: budgets 32, 16, 8" in md and "best budget" not in md.replace("## Best budget", "")
    assert runs.run(argparse.Namespace(db=str(db_path), json=True, filter=None, limit=None)) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["best_budget"][0]["state"] == "tie"
    assert listed[0]["best_budget"][0]["tied"] == [32, 16, 8]


DEMO = """
name = "demo-defaults"
[sweep]
budget = [4, 16]
baseline = ["ar", "dflash"]
repeats = 2
"""


def test_exported_recipe_is_explicit_and_plans_again_point_for_point(tmp_path, capsys):
    from ddtree.console import cli

    recipe = parse_recipe(DEMO)
    db_path = tmp_path / "d.db"
    with open_db(db_path) as db:
        run_id = sweeps.create_run(db, job_id=None, name="renamed", recipe=recipe_to_dict(recipe),
                                   engine_kind="builtin")
    out = tmp_path / "again.toml"
    assert cli.main(["--db", str(db_path), "export", str(run_id), "--format", "recipe", "-o", str(out)]) == 0
    text = out.read_text()
    capsys.readouterr()
    # what demo.toml left to defaults is written out: engine kind, device, backend, the dataset,
    # temperature, repeats, warm-up, seed; the name is the run's (sweep --name renamed it)
    for key in ('name = "renamed"', 'kind = "builtin"', 'device = "cpu"', 'backend = "auto"',
                'dataset = ["builtin:code"]', "temperature = [0.0]", "repeats = 2", "warmup = 2", "seed = 0",
                "interleave = true"):
        assert key in text, key
    # but not this machine's install (the demo pair's folders, the interpreter): the recipe is for another
    for key in ("model = ", "draft_model = ", "python = ", sys.executable):
        assert key not in text, key
    assert cli.main(["--db", str(db_path), "sweep", str(out), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    original = make_plan(recipe).to_dict()
    assert plan["points"] == original["points"]
    assert [launch["argv"] for launch in plan["launches"]] == [launch["argv"] for launch in original["launches"]]


def test_exports_carry_the_recommended_serving_setting(tmp_path, capsys):
    """16 clears the others, so every export names it as the budget to serve with; a tie says so."""
    db_path = tmp_path / "d.db"
    run_id = _seed(db_path, CLEAR)
    doc = json.loads(_export(db_path, run_id, "json", capsys))
    assert [(row["budget"], row["decided"]) for row in doc["recommended_serving"]] == [(16, True)]
    md = _export(db_path, run_id, "md", capsys)
    section = md.split("## Budget to serve with", 1)[1].split("\n## ", 1)[0]
    assert "budget 16" in section
    recipe = _export(db_path, run_id, "recipe", capsys)
    assert "# recommended serving setting" in recipe and "budget = 16" in recipe.split("recommended serving setting", 1)[1]

    tied = _seed(tmp_path / "t.db", TIED)
    doc = json.loads(_export(tmp_path / "t.db", tied, "json", capsys))
    assert [row["state"] for row in doc["recommended_serving"]] != ["clear"]


def test_markdown_says_how_many_points_finished_of_the_plan(tmp_path, capsys):
    recipe = parse_recipe(RECIPE)
    plan = make_plan(recipe)
    db_path = tmp_path / "d.db"
    with open_db(db_path) as db:
        run_id = sweeps.create_run(db, job_id=None, name=recipe.name, recipe=recipe_to_dict(recipe),
                                   engine_kind="builtin", points_total=len(plan.points))
        rows = [{**p.params(), "point_key": p.key, "idx": p.index, "baseline": p.baseline} for p in plan.points]
        ids = sweeps.ensure_points(db, run_id, rows)
        first = plan.points[0]
        sweeps.record_point(db, ids[first.key], state="done", requests=[],
                            metrics={"requests_ok": 8, "requests_failed": 0, "output_tokens": 800,
                                     "duration_s": 8.0, "output_tok_s": 100.0})
    md = _export(db_path, run_id, "md", capsys)
    assert f"points: 1 of {len(plan.points)} finished" in md
