"""The plan and the engine job name models as a user would (issue 17): the demo pair's install
path (build/__editable__... with an editable install) shows nowhere; counts read in words."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.jobs.kinds.engine import server_argv, validate
from ddtree.jobs.plan import demo_pair, format_plan, make_plan
from ddtree.jobs.recipe import parse_recipe

ROOT = Path(__file__).resolve().parents[3]
DEMO = (ROOT / "assets" / "recipes" / "demo.toml").read_text()
needs_demo = pytest.mark.skipif(not Path(demo_pair()[0]).is_dir(), reason="the demo pair is not installed")


def internal(text: str) -> list[str]:
    """What in `text` names the package's install folders."""
    return [w for w in ("__editable__", "assets/demo", "site-packages") if w in text]


def test_demo_plan_leaves_the_pair_to_the_server_and_counts_in_words():
    plan = make_plan(parse_recipe(DEMO))
    argv = list(plan.launches[0].argv)
    assert "--model" not in argv and "--draft" not in argv  # the server loads the demo pair itself
    text = format_plan(plan)
    assert internal(text) == [] and internal(json.dumps(plan.to_dict())) == []
    assert f"1 engine launch, {len(plan.points)} points" in text
    assert "warm-up: 1 request before each point" in text


def test_a_drafter_of_ones_own_on_the_demo_target_is_still_passed(tmp_path):
    recipe = DEMO.replace('device = "cpu"', f'device = "cpu"\ndraft_model = "{tmp_path}"')
    argv = list(make_plan(parse_recipe(recipe)).launches[0].argv)
    assert "--model" not in argv and argv[argv.index("--draft") + 1] == str(tmp_path)


@pytest.mark.slow
def test_dry_run_of_the_demo_recipe_prints_no_install_path(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), "sweep",
                          str(ROOT / "assets" / "recipes" / "demo.toml"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ddtree.engine.reference.server" in out.stdout and internal(out.stdout) == []


@needs_demo
def test_demo_engine_job_starts_the_server_without_the_pairs_path(tmp_path):
    spec = validate({"kind": "builtin", "demo": True})
    argv = server_argv(spec)
    assert spec["demo"] and "--model" not in argv and "--draft" not in argv
    assert internal(" ".join(argv)) == []
    (tmp_path / "mine").mkdir()
    argv = server_argv(validate({"kind": "builtin", "draft_model": str(tmp_path / "mine")}))
    assert "--model" not in argv and argv[argv.index("--draft") + 1] == str(tmp_path / "mine")
    # a model of one's own is passed as given
    argv = server_argv(validate({"model": str(tmp_path / "mine"), "algorithm": "ar"}))
    assert argv[argv.index("--model") + 1] == str(tmp_path / "mine")


def test_the_server_runs_the_sweeps_highest_concurrency_at_once():
    """Concurrency is a client-side axis on one server: past the server's default it is told to
    run that many at once (its KV pool holds as many), else those points would measure a queue."""
    import re

    low = list(make_plan(parse_recipe(re.sub(r"concurrency = \[[^]]*\]", "concurrency = [1, 4]", DEMO)))
               .launches[0].argv)
    assert "--max-running-requests" not in low
    high = list(make_plan(parse_recipe(re.sub(r"concurrency = \[[^]]*\]", "concurrency = [1, 16, 64]", DEMO)))
                .launches[0].argv)
    assert high[high.index("--max-running-requests") + 1] == "64"
