"""Faults: an engine that never becomes ready, one that dies mid-point, one that rejects everything
(saturation), a full disk for the store, resume refusals. Real subprocesses; a stand-in engine."""

import argparse
import json
import stat
import sys
from pathlib import Path

import pytest

from ddtree.jobs.supervisor import submit
from ddtree.store import sweeps
from ddtree.store.db import open_db
from ddtree.store.queries import get_job

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).resolve().parent


def fake_recipe(tmp_path, prompts_file, mode, ready_timeout_s=60.0, **sweep):
    """ready_timeout_s: how long a launch may take to announce itself; generous, as a loaded box
    takes about a second to start the stand-in engine, except where the timeout is the test."""
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'fake_engine.py'} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    table = {"budget": [2, 4], "concurrency": [1, 2], "dataset": str(prompts_file), "num_prompts": 2,
             "max_new_tokens": 4, "warmup": 0, "timeout_s": 10.0, **sweep}
    return {"name": f"fake-{mode}",
            "engine": {"kind": "builtin", "python": str(exe), "model": "/nonexistent/target",
                       "ready_timeout_s": ready_timeout_s, "env": {"FAKE_MODE": mode}},
            "sweep": table}


def run_sweep(tmp_path, recipe):
    db_path = tmp_path / "ddtree.db"
    job_id = submit(db_path, "sweep", {"recipe": recipe}, detach=False)
    db = open_db(db_path)
    job = get_job(db, job_id)
    run = db.execute("SELECT id FROM runs WHERE job_id = ?", [job_id]).fetchone()[0]
    points = sweeps.list_points(db, run)
    db.close()
    return job, points


@pytest.mark.slow
def test_engine_never_ready_fails_its_points_with_the_cause(tmp_path, prompts_file):
    job, points = run_sweep(tmp_path, fake_recipe(tmp_path, prompts_file, "hang", ready_timeout_s=2.0))
    assert job.state == "failed"
    assert len(points) == 4 and {p.state for p in points} == {"failed"}
    assert all("did not report a listening address within 2s" in p.error for p in points)


def test_engine_dying_mid_point_is_recorded_and_restarted(tmp_path, prompts_file):
    job, points = run_sweep(tmp_path, fake_recipe(tmp_path, prompts_file, "die", concurrency=[1]))
    assert [p.state for p in points] == ["failed", "failed"]
    assert all("engine died during the point (exit code 3" in p.error for p in points)
    db = open_db(tmp_path / "ddtree.db")
    names = [r[0] for r in db.execute("SELECT name FROM processes WHERE job_id = ? ORDER BY id", [job.id])]
    assert names[-2:] == ["engine-0-0", "engine-0-1"]  # a fresh engine for the second point
    db.close()


def test_saturation_skips_higher_concurrency_of_the_series(tmp_path, prompts_file):
    job, points = run_sweep(tmp_path, fake_recipe(tmp_path, prompts_file, "reject", concurrency=[1, 2, 4],
                                                  budget=[2], num_prompts=3))
    by_c = {p.concurrency: p for p in points}
    assert by_c[1].state == "failed" and by_c[1].failures == {"http 503": 3}
    assert by_c[2].state == "skipped" and "saturated at concurrency 1" in by_c[2].error
    assert by_c[4].state == "skipped"


def test_full_disk_rolls_back_the_point_and_names_the_cause(tmp_path):
    db = open_db(tmp_path / "full.db")
    run_id = sweeps.create_run(db, job_id=None, name="x", recipe={"name": "x"})
    key = json.dumps({"algorithm": "ar", "repeat": 0})  # point keys are JSON (their cell is the key less repeat)
    ids = sweeps.ensure_points(db, run_id, [{"point_key": key, "idx": 0, "engine_kind": "builtin",
                                             "algorithm": "ar", "budget": None, "tp": 1, "gpus": [],
                                             "concurrency": 1, "dataset": "d", "temperature": 0.0, "repeat": 0}])
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
    requests = [{"idx": i, "ok": True, "detail": "x" * 4000} for i in range(50)]
    with pytest.raises(sweeps.StoreFull) as info:
        sweeps.record_point(db, ids[key], state="done", metrics={"requests_ok": 50}, requests=requests)
    assert "full" in str(info.value) and "resume" in info.value.hint
    assert sweeps.get_point(db, ids[key]).state == "pending"
    assert db.execute("SELECT count(*) FROM requests").fetchone()[0] == 0
    db.close()


def test_cli_resume_refusals(tmp_path, capsys):
    from ddtree.console.commands import sweep as cmd
    from ddtree.store.errors import NotFound

    ns = dict(db=str(tmp_path / "d.db"), recipe=None, resume=None, detach=False, dry_run=False, json=False, name=None,
              yes_large=False)
    with pytest.raises(cmd.SweepUsageError) as info:
        cmd.run(argparse.Namespace(**ns))
    assert info.value.exit_code == 2
    from ddtree.store import open_db
    from ddtree.store.errors import DatabasePathError

    with pytest.raises(DatabasePathError, match="no store at"):  # a --db typo leaves no empty store behind
        cmd.run(argparse.Namespace(**{**ns, "resume": 99}))
    assert not (tmp_path / "d.db").exists()
    open_db(tmp_path / "d.db").close()
    with pytest.raises(NotFound):
        cmd.run(argparse.Namespace(**{**ns, "resume": 99}))
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[sweep]\nbudgte = [1]\n')
    from ddtree.jobs.recipe import RecipeError

    with pytest.raises(RecipeError) as info:
        cmd.run(argparse.Namespace(**{**ns, "recipe": str(bad)}))
    assert "did you mean 'budget'" in str(info.value)
    # an SGLang recipe whose interpreter has no sglang: refused before anything starts, exit 2
    sglang = tmp_path / "sglang.toml"
    sglang.write_text(f'name = "x"\n[engine]\nkind = "sglang"\nmodel = "/m/x"\npython = "{sys.executable}"\n'
                      '[sweep]\nbudget = [8, 16]\n')
    from ddtree.jobs.plan import UnsupportedEngine

    with pytest.raises(UnsupportedEngine) as info:
        cmd.run(argparse.Namespace(**{**ns, "recipe": str(sglang)}))
    assert info.value.exit_code == 2 and "could not import sglang" in str(info.value)
    missing = tmp_path / "missing.toml"
    missing.write_text('name = "x"\n[engine]\nkind = "sglang"\nmodel = "/m/x"\npython = "/nonexistent/bin/python"\n')
    with pytest.raises(UnsupportedEngine, match="does not exist"):
        cmd.run(argparse.Namespace(**{**ns, "recipe": str(missing)}))
    # the dry run still shows the plan, with the launches marked unsupported and why
    assert cmd.run(argparse.Namespace(**{**ns, "recipe": str(sglang), "dry_run": True, "json": True})) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["launches"]) == 2 and plan["launches"][0]["argv"] is None
    assert "could not import sglang" in plan["launches"][0]["unsupported"]


def test_stale_engine_log_from_another_database_is_ignored(tmp_path, prompts_file):
    # Another database in this folder (or this one before it was deleted) had a job 1 whose engine
    # announced a port that is dead now; this run's job 1 must not read that line.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    stale = json.dumps({"event": "listening", "host": "127.0.0.1", "port": dead, "url": f"http://127.0.0.1:{dead}"})
    for name in ("job-1.log", "job-1-engine-0-0.log"):
        (logs / name).write_text(stale + "\n")
    job, points = run_sweep(tmp_path, fake_recipe(tmp_path, prompts_file, "reject", budget=[2], concurrency=[1]))
    # The fake answers 503 to every request: the point failed on its requests, not on a dead engine.
    assert [p.error for p in points] == [points[0].error] and "every request failed" in points[0].error
    db = open_db(tmp_path / "ddtree.db")
    ports = [r[0] for r in db.execute("SELECT port FROM engines WHERE job_id = ?", [job.id])]
    logs_used = [r[0] for r in db.execute("SELECT log_path FROM processes WHERE job_id = ?", [job.id])]
    db.close()
    assert ports and dead not in ports
    assert str(logs / "job-1-engine-0-0.log") not in logs_used and job.log_path != str(logs / "job-1.log")
    assert (logs / "job-1-engine-0-0.log").read_text() == stale + "\n"  # the other database's log is untouched


SECRET = "hf_Sekrit1234567890"


def _everything_stored(data_dir: Path) -> str:
    """The database (every row, as SQL) and every log, as one text."""
    import sqlite3

    conn = sqlite3.connect(data_dir / "ddtree.db")
    text = "\n".join(conn.iterdump())
    conn.close()
    return text + "".join(p.read_text(errors="replace") for p in (data_dir / "logs").iterdir())


@pytest.mark.slow
def test_secret_env_is_redacted_everywhere_and_still_reaches_the_engine(tmp_path, prompts_file, capsys):
    from ddtree.console import cli

    out_file = tmp_path / "engine-env.jsonl"
    recipe = fake_recipe(tmp_path, prompts_file, "reject", budget=[2], concurrency=[1])
    recipe["engine"]["env"].update({"HF_TOKEN": SECRET, "FAKE_ENV_OUT": str(out_file), "MY_API_KEY": SECRET})
    (tmp_path / "model").mkdir()
    recipe["engine"]["model"] = str(tmp_path / "model")  # the CLI checks a local model exists
    lines = [f'name = "{recipe["name"]}"', "[engine]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in recipe["engine"].items() if k != "env"]
    lines += ["[engine.env]"] + [f"{k} = {json.dumps(v)}" for k, v in recipe["engine"]["env"].items()]
    lines += ["[sweep]"] + [f"{k} = {json.dumps(v)}" for k, v in recipe["sweep"].items()]
    path = tmp_path / "secret.toml"
    path.write_text("\n".join(lines) + "\n")
    db = str(tmp_path / "ddtree.db")

    for extra in ([], ["--json"]):
        assert cli.main(["--db", db, "sweep", str(path), "--dry-run", *extra]) == 0
        shown = capsys.readouterr().out
        assert SECRET not in shown and "<redacted>" in shown
    assert cli.main(["--db", db, "sweep", str(path), "--detach", "--json"]) == 0
    started = json.loads(capsys.readouterr().out)
    from ddtree.jobs.supervisor import wait

    assert wait(db, started["job_id"], timeout=60).terminal
    # The engine got the real value, through the runner's environment.
    assert json.loads(out_file.read_text().splitlines()[0]) == {"HF_TOKEN": SECRET}
    stored = _everything_stored(tmp_path)
    assert SECRET not in stored and "<redacted>" in stored  # runs.recipe, the launch line in the job log
    for argv in (["export", str(started["run_id"]), "--format", "json"],
                 ["export", str(started["run_id"]), "--format", "recipe"], ["runs", "--json"],
                 ["jobs", "show", str(started["job_id"])]):
        cli.main(["--db", db, *argv])
        shown = capsys.readouterr().out
        assert SECRET not in shown, argv
    # A job spec given straight to submit (the engine kind, the console) is stored redacted too.
    (tmp_path / "direct").mkdir()
    run_sweep(tmp_path / "direct", recipe)
    assert SECRET not in _everything_stored(tmp_path / "direct")
    assert len(out_file.read_text().splitlines()) == 2
    assert json.loads(out_file.read_text().splitlines()[1]) == {"HF_TOKEN": SECRET}


def test_secret_names():
    from ddtree.store.redact import REDACTED, is_secret, redact, secret_env

    assert all(is_secret(n) for n in ("HF_TOKEN", "hf_token", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"))
    assert not any(is_secret(n) for n in ("CUDA_VISIBLE_DEVICES", "FAKE_MODE", "HF_HOME"))
    doc = {"recipe": {"engine": {"env": {"HF_TOKEN": "x", "HF_HOME": "/h"}}}, "env": [["API_KEY", "y"]]}
    assert redact(doc) == {"recipe": {"engine": {"env": {"HF_TOKEN": REDACTED, "HF_HOME": "/h"}}},
                           "env": [("API_KEY", REDACTED)]}
    assert secret_env(doc) == {"HF_TOKEN": "x", "API_KEY": "y"} and secret_env(redact(doc)) == {}


@pytest.mark.slow
def test_runner_killed_at_several_moments_then_resumed_records_every_point_once(tmp_path, prompts_file, capsys):
    """Fault injection: SIGKILL of the detached runner after the first point, mid-point, and after
    further points, each followed by `sweep --resume`; the grid ends with every point done exactly
    once (one row, its requests once), no engine row left starting/running and no engine alive."""
    import itertools
    import os
    import signal
    import time

    from ddtree.console.commands import sweep as cmd
    from ddtree.jobs.procs import is_alive

    db_path = tmp_path / "ddtree.db"
    recipe = fake_recipe(tmp_path, prompts_file, "ok", budget=[2, 4, 6], concurrency=[1], repeats=2,
                         num_prompts=2)
    # The stand-in engine answers a request only for a ticket taken from this folder (fake_engine's
    # take_ticket). Each moment gets exactly the tickets that lead to it, so the runner is held there,
    # its next request waiting, until it is killed, however slow the box: no race with the clock.
    # Tickets are handed out only once a resume has stopped the killed runner's engine, which could
    # otherwise take one for a request that nobody records.
    gate = tmp_path / "gate"
    gate.mkdir()
    recipe["engine"]["env"]["FAKE_GATE"] = str(gate)
    serial = itertools.count()
    total = 3 * 2  # three budgets, two repeats each, two prompts (requests) each
    job_id = submit(db_path, "sweep", {"recipe": recipe}, detach=True)
    db = open_db(db_path)

    def until(predicate, what, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def run_id():
        row = db.execute("SELECT id FROM runs").fetchone()
        return row[0] if row else None

    def states():
        return [p.state for p in sweeps.list_points(db, run_id())] if run_id() else []

    def tickets_left():
        return len(os.listdir(gate))

    def kill_runner(job):
        until(lambda: get_job(db, job).pid is not None, "the runner")
        runner = get_job(db, job)
        os.kill(runner.pid, signal.SIGKILL)
        until(lambda: not is_alive(runner.pid, runner.pid_started), "the runner to die")

    def resume():
        assert cmd.run(argparse.Namespace(db=str(db_path), recipe=None, resume=run_id(), detach=True, dry_run=False,
                                          json=True, name=None, yes_large=False)) == 0
        return json.loads(capsys.readouterr().out)["job_id"]

    # (requests to let through, the moment they lead to, the points done when it is reached)
    moments = [(2, lambda: states().count("done") >= 1, 1),  # between points: the second one's request is held
               (1, lambda: "running" in states() and tickets_left() == 0, 1),  # in the middle of a point
               (6, lambda: states().count("done") >= 4, 4)]  # later, after a restart of the engine
    killed = []
    for n, moment, done in moments:
        for _ in range(n):
            (gate / f"ticket-{next(serial)}").touch()
        until(moment, "the moment to kill the runner")
        kill_runner(job_id)
        killed.append(job_id)
        assert states().count("done") == done and tickets_left() == 0
        job_id = resume()  # marks the killed job lost and stops its engine before the next tickets
    gate.rmdir()  # every request is answered from now on
    until(lambda: get_job(db, job_id).terminal, "the last resume to finish", 90)

    points = sweeps.list_points(db, run_id())
    assert len(points) == total and len({p.point_key for p in points}) == total
    assert [p.state for p in points] == ["done"] * total
    requests = db.execute("SELECT point_id, count(*), count(DISTINCT idx) FROM requests GROUP BY point_id").fetchall()
    assert sorted(r[0] for r in requests) == sorted(p.id for p in points)
    assert all(n == distinct == 2 for _, n, distinct in requests)  # each request once, not once per attempt
    open_rows = db.execute("SELECT id, job_id, state FROM engines WHERE state IN ('starting', 'running')").fetchall()
    assert open_rows == []
    assert {get_job(db, j).state for j in killed} == {"lost"} and get_job(db, job_id).state == "succeeded"
    pids = [r[0] for r in db.execute("SELECT pid FROM engines WHERE pid IS NOT NULL")]
    assert pids and not any(is_alive(pid) for pid in pids)
    db.close()
