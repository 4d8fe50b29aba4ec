"""The real entry point: dry run output, one-line errors with exit 2, never a traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import finished_run, write_recipe

ROOT = Path(__file__).resolve().parents[3]


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), *args],
                          capture_output=True, text=True, timeout=60)


def test_dry_run_json_of_the_demo_recipe_starts_nothing(tmp_path):
    out = cli(tmp_path, "sweep", str(ROOT / "assets" / "recipes" / "demo.toml"), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert len(plan["launches"]) == 1 and len(plan["points"]) == 8
    assert plan["launches"][0]["argv"][-2:] == ["--port", "0"]
    assert not (tmp_path / "d.db").exists()


def test_dry_run_shows_the_name_the_run_would_get(tmp_path):
    demo = str(ROOT / "assets" / "recipes" / "demo.toml")
    out = cli(tmp_path, "sweep", demo, "--dry-run", "--name", "mine")
    assert out.returncode == 0 and out.stdout.startswith("sweep 'mine':"), out.stdout + out.stderr
    out = cli(tmp_path, "sweep", demo, "--dry-run", "--json", "--name", "mine")
    assert out.returncode == 0 and json.loads(out.stdout)["name"] == "mine", out.stderr


@pytest.mark.slow
def test_dry_run_probes_an_sglang_interpreter_unless_no_probe(tmp_path):
    # The documented behaviour: a dry run starts no server, but an sglang/vllm recipe's interpreter is
    # run once to read what it accepts; --no-probe runs nothing at all.
    calls = tmp_path / "calls.txt"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    recipe = tmp_path / "sglang.toml"
    recipe.write_text(f'name = "x"\n[engine]\nkind = "sglang"\nmodel = "{tmp_path / "model"}"\n'
                      f'python = "{python}"\n[sweep]\nbudget = [8]\n')
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--no-probe", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert not calls.exists()
    assert plan["launches"][0]["argv"] is None and "--no-probe" in plan["launches"][0]["unsupported"]
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    assert calls.exists()  # the probe ran the interpreter (and found no sglang in it)
    out = cli(tmp_path, "sweep", str(recipe), "--no-probe")
    assert out.returncode == 2 and out.stderr.startswith("error: --no-probe applies to --dry-run only")
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--detach")  # it was dropped unseen
    assert out.returncode == 2 and out.stderr.startswith("error: --detach does nothing with --dry-run")


@pytest.mark.slow
def test_bad_input_is_one_line_with_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[engine]\nalgorithm = "ar"\n[sweep]\nbudget = [4]\n')
    for args in (("sweep", str(bad)), ("sweep", str(tmp_path / "missing.toml")), ("export", "7", "--format", "md"),
                 ("sweep",), ("export", "x")):
        out = cli(tmp_path, *args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(("error:", "ddtree-console")), out.stderr


def test_empty_recipe_and_name_are_refused(tmp_path):
    demo = str(ROOT / "assets" / "recipes" / "demo.toml")
    for args, expected in ((("", "--dry-run"), "error: the recipe file name is empty"),
                           ((demo, "--dry-run", "--name", ""), "error: --name is empty"),
                           ((demo, "--dry-run", "--name", "  "), "error: --name is empty"),
                           (("--resume", "1", "--name", ""), "error: --name is empty")):
        out = cli(tmp_path, "sweep", *args)
        assert out.returncode == 2 and out.stderr.startswith(expected) and out.stderr.count("\n") == 1, \
            (args, out.stderr)
    assert not (tmp_path / "d.db").exists()


def test_a_resume_with_nothing_left_answers_json_with_json(tmp_path):
    run_id, job_id = finished_run(tmp_path / "d.db", done=True)
    out = cli(tmp_path, "sweep", "--resume", str(run_id), "--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert json.loads(out.stdout) == {"job_id": None, "run_id": run_id, "state": None, "nothing_to_resume": True,
                                      "points": {"pending": 0, "running": 0, "done": 2, "failed": 0, "skipped": 0}}
    out = cli(tmp_path, "sweep", "--resume", str(run_id))
    assert out.returncode == 0 and out.stdout == f"run {run_id}: all 2 points are finished; nothing to resume\n"


def test_a_resume_with_nothing_left_ends_a_run_whose_runner_died_before_its_end(tmp_path):
    from ddtree.store import open_db, sweeps

    run_id, job_id = finished_run(tmp_path / "d.db", done=True)
    with open_db(tmp_path / "d.db") as db:  # every point done, then the runner died before finish_run
        sweeps.update_run(db, run_id, state="running", ended_at=None)
    out = cli(tmp_path, "sweep", "--resume", str(run_id))
    assert out.returncode == 0 and "nothing to resume" in out.stdout
    with open_db(tmp_path / "d.db") as db:
        run = sweeps.get_run(db, run_id)
    assert (run.state, run.job_id) == ("succeeded", job_id) and run.ended_at is not None


@pytest.mark.slow
def test_a_missing_prompt_file_is_refused_before_the_store(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "x"\n[sweep]\ndataset = "{tmp_path / "nope.jsonl"}"\n')
    for dry in (("--dry-run",), ()):
        out = cli(tmp_path, "sweep", str(recipe), *dry)
        assert out.returncode == 2, (dry, out.stderr)
        assert out.stderr == f"error: sweep.dataset '{tmp_path / 'nope.jsonl'}': prompt file not found: " \
                             f"{tmp_path / 'nope.jsonl'}\n"
    assert not (tmp_path / "d.db").exists()


def test_dry_run_no_probe_warns_once_of_a_prompt_file_not_on_this_machine(tmp_path):
    """--no-probe checks nothing of this machine: the prompt file may be on the one that runs the
    sweep, so the plan prints (once, however many points use it) instead of being refused."""
    missing = "/data/prompts/on-the-gpu-box.jsonl"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "x"\n[sweep]\ndataset = "{missing}"\nbudget = [4, 8, 16]\n')
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--no-probe")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    warned = [line for line in out.stdout.splitlines() if missing in line and line.startswith("warning:")]
    assert warned == [f"warning: sweep.dataset '{missing}' is not on this machine (prompt file not found: "
                      f"{missing}); the machine that runs the sweep needs it"]
    assert sum(f"{missing} r0" in line for line in out.stdout.splitlines()) == 3  # the points still planned
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--no-probe", "--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert [w for w in json.loads(out.stdout)["warnings"] if missing in w] == [warned[0].removeprefix("warning: ")]
    assert not (tmp_path / "d.db").exists()
    # a builtin set that is not shipped, or a file that is here and bad, is still refused
    recipe.write_text('name = "x"\n[sweep]\ndataset = "builtin:nope"\n')
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--no-probe")
    assert out.returncode == 2 and out.stderr.startswith("error: sweep.dataset 'builtin:nope': no builtin prompt set")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    recipe.write_text(f'name = "x"\n[sweep]\ndataset = "{tmp_path / "bad.jsonl"}"\n')
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--no-probe")
    assert out.returncode == 2 and "is not JSON" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "d.db").exists()


@pytest.mark.slow
def test_name_names_the_run_and_a_resume_keeps_it(tmp_path, tiny_pair, prompts_file):
    from ddtree.store import open_db

    recipe = write_recipe(tmp_path / "r.toml", tiny_pair, prompts_file)
    out = cli(tmp_path, "sweep", str(recipe), "--detach", "--json", "--name", "mine")
    assert out.returncode == 0, out.stderr
    started = json.loads(out.stdout)
    assert cli(tmp_path, "jobs", "cancel", str(started["job_id"])).returncode == 0
    with open_db(tmp_path / "d.db") as db:
        assert db["runs"].get(started["run_id"])["name"] == "mine"
    listed = cli(tmp_path, "runs", "--filter", "mine")
    assert listed.returncode == 0 and "mine" in listed.stdout
    again = cli(tmp_path, "sweep", "--resume", str(started["run_id"]), "--detach", "--json")
    assert again.returncode == 0, again.stderr
    job_id = json.loads(again.stdout)["job_id"]
    assert cli(tmp_path, "jobs", "cancel", str(job_id)).returncode == 0
    with open_db(tmp_path / "d.db") as db:
        assert db["jobs"].get(job_id)["name"] == "mine"


@pytest.mark.slow
def test_ctrl_c_cancels_a_foreground_sweep_quietly(tmp_path, tiny_pair, prompts_file):
    import os
    import signal
    import time

    from ddtree.store import open_db

    recipe = write_recipe(tmp_path / "r.toml", tiny_pair, prompts_file, max_new_tokens=64, num_prompts=20)
    proc = subprocess.Popen([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), "sweep",
                             str(recipe)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # Ctrl-C once the engine serves points
            if (tmp_path / "d.db").exists():
                with open_db(tmp_path / "d.db") as db:
                    if db.execute("SELECT count(*) FROM points WHERE state = 'running'").fetchone()[0]:
                        break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "cancelled" in out and "--resume" in out and "error:" not in err and "Traceback" not in err


def test_relative_paths_in_a_recipe_are_stored_absolute(tmp_path, tiny_pair, prompts_file):
    import shutil

    from ddtree.store import open_db

    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    shutil.copytree(tiny_pair[0], work / "models" / "target")
    shutil.copy(prompts_file, work / "p.jsonl")
    (work / "r.toml").write_text('name = "rel"\n[engine]\nmodel = "models/target"\n'
                                 '[sweep]\ndataset = ["p.jsonl", "builtin:code"]\n')
    plan = subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), "sweep",
                           "r.toml", "--dry-run", "--json"], cwd=work, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    points = json.loads(plan.stdout)["points"]
    assert {p["dataset"] for p in points} == {str(work / "p.jsonl"), "builtin:code"}
    assert str(work / "models" / "target") in json.loads(plan.stdout)["launches"][0]["argv"]
