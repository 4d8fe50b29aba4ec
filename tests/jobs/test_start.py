"""jobs.start: the one way a sweep starts (the CLI and the console's form both call it)."""

import json
import subprocess

import pytest

from ddtree.engine.serving.prompts import DatasetError
from ddtree.jobs.recipe import parse_recipe
from ddtree.jobs.start import git_revision, plan_sweep, start_sweep
from ddtree.store import open_db


class FakeSubmit:
    """supervisor.submit that records its call and writes nothing (no runner starts)."""

    def __init__(self, db_path):
        self.db_path, self.calls, self.runs_seen = db_path, [], None

    def __call__(self, db_path, kind, spec, *, name, detach, secrets=None):
        with open_db(db_path) as db:
            self.runs_seen = [dict(r) for r in db["runs"].rows]  # what existed when the job was asked for
        self.calls.append({"kind": kind, "spec": spec, "name": name, "detach": detach, "secrets": secrets})
        return 41


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "work" / "p.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    return path


def recipe_text(dataset: str) -> str:
    return (f'name = "r"\n[engine]\nenv = {{ HF_TOKEN = "hf_real_value" }}\n'
            f'[sweep]\ndataset = ["{dataset}", "builtin:code"]\nbudget = [4]\n')


def test_a_started_sweep_stores_absolute_redacted_and_queued(tmp_path, prompts, monkeypatch):
    db_path = tmp_path / "d.db"
    fake = FakeSubmit(db_path)
    monkeypatch.setattr("ddtree.jobs.supervisor.submit", fake)
    monkeypatch.chdir(prompts.parent)
    seen = []
    started = start_sweep(db_path, parse_recipe(recipe_text("p.jsonl")), name="mine", on_run=seen.append)
    assert (started.run_id, started.job_id, started.name) == (seen[0], 41, "mine")
    (call,) = fake.calls
    assert call == {"kind": "sweep", "spec": {"run_id": started.run_id}, "name": "mine", "detach": True,
                    "secrets": {"HF_TOKEN": "hf_real_value"}}
    (run,) = fake.runs_seen
    assert run["state"] == "queued" and run["name"] == "mine" and run["points_total"] == 2
    recipe = json.loads(run["recipe"])
    assert recipe["sweep"]["dataset"] == [str(prompts), "builtin:code"]
    assert "hf_real_value" not in run["recipe"]


def test_a_refused_recipe_writes_nothing(tmp_path, monkeypatch):
    db_path = tmp_path / "d.db"
    fake = FakeSubmit(db_path)
    monkeypatch.setattr("ddtree.jobs.supervisor.submit", fake)
    with pytest.raises(DatasetError) as info:
        start_sweep(db_path, parse_recipe(recipe_text("/nonexistent/p.jsonl")), on_run=fake.calls.append)
    assert info.value.exit_code == 2 and "prompt file not found" in str(info.value)
    assert not db_path.exists() and fake.calls == []


def test_the_dry_run_plan_is_redacted(prompts):
    planned = plan_sweep(parse_recipe(recipe_text(str(prompts))), check=False)
    assert dict(planned.recipe.engine.env) == {"HF_TOKEN": "<redacted>"}
    assert planned.secrets == {"HF_TOKEN": "hf_real_value"}


@pytest.mark.parametrize("content, expected", [
    (None, "prompt file not found"), (b"", "holds no prompts"), (b"{not json\n", "is not JSON"),
    (b'{"x": 1}\n', "holds no prompt"), (bytes(range(256)), "cannot read"),
])
def test_the_dry_run_refuses_a_prompt_set_as_a_start_does(tmp_path, content, expected):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_bytes(content)
    errors = []
    for check in (False, True):
        with pytest.raises(DatasetError) as info:
            plan_sweep(parse_recipe(recipe_text(str(path))), check=check)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and errors[0].startswith(f"sweep.dataset '{path}': ") and expected in errors[0]
    with pytest.raises(DatasetError, match="no builtin prompt set 'builtin:nope'"):
        plan_sweep(parse_recipe(recipe_text("builtin:nope")), check=False)


def test_only_the_dry_run_without_probe_lets_a_missing_prompt_file_through(tmp_path):
    """probe=False with check=False is `sweep --dry-run --no-probe`: the plan carries the warning;
    a dry run that probes, and every real start (check=True), refuse the same recipe."""
    missing = str(tmp_path / "elsewhere" / "p.jsonl")
    recipe = parse_recipe(recipe_text(missing))
    planned = plan_sweep(recipe, probe=False, check=False)
    assert [w for w in planned.plan.warnings if missing in w] == [
        f"sweep.dataset '{missing}' is not on this machine (prompt file not found: {missing}); "
        "the machine that runs the sweep needs it"]
    for probe, check in ((True, False), (True, True), (False, True)):
        with pytest.raises(DatasetError, match="prompt file not found"):
            plan_sweep(recipe, probe=probe, check=check)


def test_git_revision_names_the_commit_and_a_dirty_file(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    if subprocess.run([*git, "init", "-q"], capture_output=True).returncode != 0:
        pytest.skip("no git")
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "r"\n')
    subprocess.run([*git, "add", "r.toml"], check=True)
    subprocess.run([*git, "commit", "-qm", "r"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_revision(recipe) == sha
    recipe.write_text('name = "changed"\n')
    assert git_revision(recipe) == f"{sha}+dirty"
    assert git_revision("/") is None or not git_revision("/").endswith("+dirty")
