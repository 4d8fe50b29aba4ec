"""End to end: a detached sweep job on the builtin engine fills a real SQLite file; the runner is
killed with SIGKILL between points; resume completes the grid with each point exactly once; the
exports round-trip."""

import argparse
import csv
import io
import json
import os
import signal
import time

import pytest

from ddtree.console.commands import export, sweep as cmd
from ddtree.jobs.plan import make_plan
from ddtree.jobs.recipe import load_recipe, parse_recipe, recipe_from_dict
from ddtree.store import sweeps
from ddtree.store.db import open_db
from ddtree.store.queries import get_job

from .conftest import finished_run, write_recipe

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _args(db, **kw):
    base = dict(db=str(db), recipe=None, resume=None, detach=False, dry_run=False, json=True, name=None,
                yes_large=False)
    return argparse.Namespace(**{**base, **kw})


def _wait(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_detached_sweep_killed_then_resumed_fills_each_point_once(tmp_path, tiny_pair, prompts_file, capsys):
    db_path = tmp_path / "ddtree.db"
    # two repeats of three specs at one concurrency: six points, run A B C A B C
    recipe_path = write_recipe(tmp_path / "tiny.toml", tiny_pair, prompts_file, repeats=2, concurrency=[1])
    recipe = load_recipe(recipe_path)
    planned = make_plan(recipe).points
    assert cmd.run(_args(db_path, recipe=str(recipe_path), detach=True)) == 0
    started = json.loads(capsys.readouterr().out)
    run_id, job_id = started["run_id"], started["job_id"]

    db = open_db(db_path)

    def two_done():
        return sum(p.state == "done" for p in sweeps.list_points(db, run_id)) >= 2

    _wait(two_done, 150, "two finished points")
    job = get_job(db, job_id)
    os.kill(job.pid, signal.SIGKILL)  # the runner dies; its engine lives on until reconcile stops it
    _wait(lambda: not os.path.exists(f"/proc/{job.pid}") or open(f"/proc/{job.pid}/stat").read().split()[2] == "Z",
          10, "the runner to die")
    before = {p.point_key: p for p in sweeps.list_points(db, run_id)}
    assert 2 <= sum(p.state == "done" for p in before.values()) < len(planned)

    # resuming while the old job still looks active works because its runner is gone
    assert cmd.run(_args(db_path, resume=run_id)) == 0
    finished = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert finished["state"] == "succeeded" and finished["points"]["done"] == len(planned)
    assert get_job(db, job_id).state == "lost"

    points = sweeps.list_points(db, run_id)
    assert sorted(p.point_key for p in points) == sorted(p.key for p in planned)  # each exactly once
    cells = [(p.cell_key, p.repeat) for p in points]
    assert len(set(cells)) == len(cells) == 6 and len({p.cell_key for p in points}) == 3
    assert [(p.algorithm, p.budget, p.repeat) for p in points] == [
        ("ar", None, 0), ("ddtree", 2, 0), ("ddtree", 6, 0), ("ar", None, 1), ("ddtree", 2, 1), ("ddtree", 6, 1)]
    for p in points:
        if before[p.point_key].state == "done":
            assert p.ended_at == before[p.point_key].ended_at  # not run again
        assert p.state == "done" and p.requests_ok == 4 and p.requests_failed == 0
        assert p.output_tok_s > 0 and p.req_s > 0 and p.ttft_p50 > 0 and p.e2e_p99 >= p.e2e_p50
        if p.algorithm == "ar":  # plain decoding has no acceptance, as with SGLang
            assert p.tau_weighted is None and p.tau_mean is None
        else:
            assert 1.0 <= p.tau_weighted <= 4 and 1.0 <= p.tau_mean <= 4 and sum(p.tau_hist) > 0
        assert p.speedup_vs_ar is not None and p.speedup_vs_ar > 0
        n = db.execute("SELECT count(*) FROM requests WHERE point_id = ?", [p.id]).fetchone()[0]
        assert n == 4
    run = sweeps.get_run(db, run_id)
    assert run.state == "succeeded" and run.points_total == len(planned)
    assert run.hardware["host"]["cpus_logical"] >= 1 and "python" in run.software
    assert recipe_from_dict(run.recipe) == recipe
    db.close()

    # nothing left: a second resume says so and starts nothing
    assert cmd.run(_args(db_path, resume=run_id, json=False)) == 0
    assert "nothing to resume" in capsys.readouterr().out

    # exports
    out = tmp_path / "run.toml"
    for fmt in ("csv", "json", "md", "recipe"):
        assert export.run(argparse.Namespace(db=str(db_path), run_id=run_id, format=fmt, output=str(out) + fmt)) == 0
    # the exported recipe writes every setting out (but this machine's interpreter, which the recipe
    # left to the machine that runs it), and plans again point for point as the run did
    exported = (tmp_path / "run.tomlrecipe").read_text()
    assert "python = " not in exported and "seed = 0" in exported and "repeats = 2" in exported
    again = make_plan(parse_recipe(exported))
    assert [p.to_dict() for p in again.points] == [p.to_dict() for p in planned]
    assert [p.key for p in again.points] == [p.point_key for p in sweeps.list_points(open_db(db_path), run_id)]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "run.tomlcsv").read_text())))
    assert len(rows) == len(planned) and float(rows[0]["output_tok_s"]) > 0
    data = json.loads((tmp_path / "run.tomljson").read_text())
    assert len(data["points"]) == len(planned) and len(data["summary"]) == 3
    stats = data["summary"][1]["output_tok_s_stats"]
    assert stats["n"] == 2 and stats["ci_low"] <= stats["mean"] <= stats["ci_high"]
    assert data["summary"][1]["vs_ar"]["n"] == 2  # paired repeat by repeat
    assert data["best_budget"][0]["state"] in ("best", "tie")
    md = (tmp_path / "run.tomlmd").read_text()
    assert md.count("\n| ddtree |") == 2 and "| ar |" in md


def test_a_resume_with_nothing_left_leaves_the_run_as_it_was(tmp_path):
    from ddtree.jobs.supervisor import submit

    db_path = tmp_path / "d.db"
    run_id, first_job = finished_run(db_path, done=True)
    with open_db(db_path) as db:
        before = sweeps.get_run(db, run_id)
    job_id = submit(db_path, "sweep", {"run_id": run_id}, name="again", detach=False)
    with open_db(db_path) as db:
        run, job = sweeps.get_run(db, run_id), get_job(db, job_id)
    assert job_id != first_job and job.state == "succeeded"
    assert (run.job_id, run.state, run.ended_at) == (first_job, "succeeded", before.ended_at)
    assert job.progress_message == f"run {run_id}: all 2 points are finished; nothing to resume"
    assert job.progress_done == job.progress_total == 2
    assert job.result["nothing_to_resume"] is True
