"""Error lines stay clean: progress bars stay in logs, failures say why, read-only stores say so."""

import sqlite3

import pytest

from ddtree.console import cli
from ddtree.engine.serving.launch import BUILTIN_MODULE
from ddtree.jobs.logfile import error_tail

pytestmark = pytest.mark.timeout(60)

BAR_LOG = ("loading the target\n"
           + "".join(f"\rLoading weights:  {p}%|{'#' * (p // 10)}{' ' * (10 - p // 10)}| {p // 5}/20 "
                     f"[00:01<00:02, 12.5it/s]" for p in range(0, 101, 5))
           + "\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
           + "ValueError: budget 5000 exceeds this engine's maximum 1024 and here is the rest of a long message\n"
           + "Loading weights: 100%|##########| 20/20 [00:02<00:00, 9.9it/s]\n")


def test_error_tail_skips_progress_bars_and_keeps_the_whole_error():
    tail = error_tail(BAR_LOG)
    assert tail == "ValueError: budget 5000 exceeds this engine's maximum 1024 and here is the rest of a long message"
    assert error_tail("one\ntwo\nthree\nfour\n") == "two | three | four"
    assert error_tail("50%|#####     | 1/2 [00:01<00:01, 1.0s/it]") == ""


def test_the_engine_start_message_uses_it(tmp_path):
    from ddtree.jobs.engine_process import log_tail

    log = tmp_path / "engine.log"
    log.write_text(BAR_LOG)
    for got in (log_tail(str(log)), log_tail(log, 4)):
        assert "Loading weights" not in got and got.startswith("ValueError: budget 5000") and got.endswith("message")


def test_serve_execs_the_server_without_progress_bars(monkeypatch):
    import os

    seen = {}

    def fake_execve(path, argv, env):
        seen.update(path=path, argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(os, "execve", fake_execve)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("exec'd with this process's environment"))
    with pytest.raises(SystemExit):
        cli.main(["serve", "--port", "0"])
    assert seen["env"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert seen["argv"][1:3] == ["-m", BUILTIN_MODULE]


def test_a_failed_foreground_job_prints_an_error_line(tmp_path, capsys):
    code = cli.main(["--db", str(tmp_path / "d.db"), "jobs", "submit", "sleep", "--spec",
                     '{"seconds": 0, "fail": true}'])
    out, err = capsys.readouterr()
    assert code == 1 and err.startswith("error: job 1 failed: ") and err.count("\n") == 1


def test_a_read_only_store_gives_a_hint(tmp_path, capsys, monkeypatch):
    from ddtree.store import db as store_db
    from ddtree.store import open_db

    path = tmp_path / "d.db"
    open_db(path).close()

    def read_only(p):  # what chmod 444 gives a non-root user (root ignores the mode)
        return store_db.Database(sqlite3.connect(f"file:{p}?mode=ro", uri=True, check_same_thread=False))

    monkeypatch.setattr(store_db, "connect", read_only)
    code = cli.main(["--db", str(path), "jobs", "submit", "sleep", "--spec", '{"seconds": 0}'])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "read-only" in err and "writable" in err


def test_sweep_final_line_names_the_first_error(tmp_path, capsys, monkeypatch):
    """Points that fail while others succeed: the CLI's last line says why the first one failed."""
    from ddtree.console.commands import sweep as sweep_cmd
    from ddtree.store import open_db, sweeps
    from ddtree.jobs.plan import point_key

    db_path = tmp_path / "d.db"
    with open_db(db_path) as db:
        run = sweeps.create_run(db, job_id=None, name="r", recipe={"name": "r"}, engine_kind="builtin",
                                points_total=2)

    def fake_submit(path, kind, spec, *, name, detach, secrets=None):
        from ddtree.jobs.model import create_job, set_state

        with open_db(path) as db:
            planned = []
            for n, c in enumerate((1, 2)):
                params = {"engine_kind": "builtin", "algorithm": "ar", "budget": None, "tp": 1, "gpus": [],
                          "concurrency": c, "dataset": "builtin:code", "temperature": 0.0, "repeat": 0}
                planned.append({**params, "point_key": point_key(params), "idx": n})
            ids = sweeps.ensure_points(db, run, planned)
            sweeps.mark_point(db, ids[planned[0]["point_key"]], "failed",
                              error="every request failed (HTTP 400: budget too large)")
            job = create_job(db, "sweep", {"run_id": run})
            for state in ("starting", "running", "succeeded"):
                set_state(db, job, state)
        return job

    monkeypatch.setattr("ddtree.jobs.supervisor.submit", fake_submit)
    args = type("A", (), {"detach": False, "json": False})()
    code = sweep_cmd._start(args, db_path, run, "r")
    err = capsys.readouterr().err
    assert code == 0
    assert err == "first error: every request failed (HTTP 400: budget too large)\n"
