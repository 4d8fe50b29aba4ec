"""End to end on the demo pair: a small foreground sweep with the builtin engine fills every point
with plausible metrics, and the trained drafter's acceptance shows (random weights stay near 1)."""

import argparse
import json

import pytest

from ddtree.console.commands import sweep as cmd
from ddtree.engine.demo import demo_paths
from ddtree.store import sweeps
from ddtree.store.db import open_db

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

RECIPE = """
name = "demo-e2e"
[engine]
kind = "builtin"
device = "cpu"
[sweep]
budget = [4, 16]
concurrency = [1, 2]
dataset = "builtin:code"
num_prompts = 4
max_new_tokens = 16
warmup = 1
baseline = ["ar", "dflash"]
"""


def test_demo_pair_sweep_fills_points_with_real_acceptance(tmp_path, capsys):
    demo_paths()  # the shipped pair must be there
    recipe = tmp_path / "demo.toml"
    recipe.write_text(RECIPE)
    db_path = tmp_path / "ddtree.db"
    args = argparse.Namespace(db=str(db_path), recipe=str(recipe), resume=None, detach=False, dry_run=False,
                              json=True, name=None, yes_large=False)
    assert cmd.run(args) == 0
    finished = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert finished["state"] == "succeeded"

    db = open_db(db_path)
    points = sweeps.list_points(db, finished["run_id"])
    assert len(points) == 8  # (ar, dflash, ddtree@4, ddtree@16) x concurrency 1, 2
    for p in points:
        assert p.state == "done" and p.requests_ok == 4 and p.requests_failed == 0, p
        assert p.output_tok_s > 0 and p.ttft_p50 > 0 and p.e2e_p99 >= p.e2e_p50
        assert p.speedup_vs_ar is not None and p.speedup_vs_ar > 0
        if p.algorithm == "ar":
            assert p.tau_weighted is None
        else:  # between 1 and the block size, and clearly above what random weights reach
            assert 1.3 < p.tau_weighted <= 16, p
    db.close()
