import json
import os
import subprocess
import sys
import time

import pytest

from ddtree.console import cli
from ddtree.jobs import wait
from ddtree.jobs.model import create_job, set_state
from ddtree.store import open_db
from ddtree.store.queries import get_job, insert_row

pytestmark = pytest.mark.timeout(60)

EXE = os.path.join(os.path.dirname(sys.executable), "ddtree-console")


@pytest.fixture
def db_path(tmp_path, monkeypatch):
    path = str(tmp_path / "ddtree.db")
    monkeypatch.setenv("DDTREE_DB", path)
    return path


def main(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = main(capsys, "--version")
    assert code == 0 and out.startswith("ddtree-console 0.")
    code, out, _ = main(capsys, "--db", "/nonexistent/x.db", "--version")
    assert code == 0 and out.startswith("ddtree-console ")


@pytest.mark.parametrize("argv", [[], *[[c] for c in cli.COMMANDS], ["jobs", "show"], ["jobs", "cancel"], ["jobs", "logs"], ["jobs", "submit"]])
def test_help_of_every_command(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith("usage: ddtree-console")
    assert len(out.splitlines()) >= 4  # a description and options, not just a usage line
    if not argv:
        for command in cli.COMMANDS:
            assert command in out


def test_serve_help_says_the_budget_the_server_takes_by_default(capsys):
    # `serve` passes no --budget unless given, so its help must name the server's own default
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "node budget (default: 16, capped" in out


def test_jobs_help_says_what_it_does_and_that_the_subcommand_is_optional(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "list, show, start, cancel and follow jobs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["jobs", "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert usage == ["usage: ddtree-console jobs [-h] [--json] [--limit N | --all] [--db PATH]",
                     "       ddtree-console jobs {show,cancel,logs,submit} ..."]


def test_usage_errors_exit_2(capsys):
    # argparse's own errors follow the house format too: one line `error: ... (hint)`, exit 2.
    cases = {("jobs", "cancel", "x"): "ddtree-console jobs cancel --help", ("jobs", "cancel"): "required: id",
             ("nope",): "invalid choice: 'nope'", ("jobs", "cancel", "1", "--grace", "-1"): "--grace",
             ("serve", "--port", "99999"): "ddtree-console serve --help",
             ("export", "1", "--format", "xls"): "invalid choice: 'xls'", ("export",): "RUN_ID",
             ("jobs", "--limit", "0"): "--limit: must be at least 1", ("runs", "--limit", "-1"): "at least 1",
             ("jobs", "--limit", str(2**70)): "--limit: must be at most", ("runs", "--limit", str(2**63)): "at most",
             # leftovers are blamed on the command they were given to, not on the top level
             ("jobs", "show", "1", "2"): "unrecognized arguments: 2 (see `ddtree-console jobs show --help`)",
             ("runs", "extra"): "(see `ddtree-console runs --help`)",
             ("jobs", "--bogus"): "(see `ddtree-console jobs --help`)",
             ("--bogus", "jobs"): "(see `ddtree-console --help`)",
             ("jobs", "--all", "--limit", "2"): "--limit: not allowed with argument --all",
             # an empty path is a mistake, not "use the default"
             ("--db=", "jobs"): "--db: expected a path, got an empty string",
             ("--db", ""): "--db: expected a path, got an empty string",
             ("jobs", "show", "1", "--db", ""): "(see `ddtree-console jobs show --help`)",
             # the console's own option given to a command was dropped unseen
             ("--demo", "jobs"): "--demo starts the console with the demo engine; it does nothing with `jobs`"}
    for argv, expected in cases.items():
        with pytest.raises(SystemExit) as exit_:
            cli.main(list(argv))
        err = capsys.readouterr().err
        assert exit_.value.code == 2
        assert err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err, err
        assert expected in err


def test_multiline_error_messages_print_on_one_line(capsys, monkeypatch):
    from ddtree.engine.errors import EngineError

    def fail(args):
        raise EngineError("cannot fetch x/y:\nAn error happened\n\n  while trying", "download it first")

    monkeypatch.setattr(cli, "load_command", lambda name: type("M", (), {
        "add_parser": staticmethod(lambda sub: sub.add_parser(name)), "run": staticmethod(fail)})())
    code, out, err = main(capsys, "runs")
    assert code == 1 and out == ""
    assert err == "error: cannot fetch x/y: An error happened while trying (download it first)\n"


def test_jobs_list_show_and_json(db_path, capsys):
    open_db(db_path).close()
    code, out, _ = main(capsys, "jobs")
    assert code == 0 and "no jobs yet" in out
    with open_db(db_path) as db:
        a = create_job(db, "sleep", {"seconds": 1.0, "fail": False, "message": ""}, name="nap")
        set_state(db, a, "starting")
        set_state(db, a, "running")
        set_state(db, a, "succeeded", result={"slept_s": 1.0})
        b = create_job(db, "shell", {"argv": ["true"]})
    code, out, _ = main(capsys, "jobs")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["ID", "KIND", "NAME", "STATE", "PROGRESS", "CREATED", "TOOK", "INFO"]
    assert lines[1].split()[:4] == [str(b), "shell", "-", "queued"]
    assert lines[2].split()[:4] == [str(a), "sleep", "nap", "succeeded"]
    code, out, _ = main(capsys, "jobs", "--json")
    doc = json.loads(out)
    assert [j["id"] for j in doc] == [b, a] and doc[1]["result"] == {"slept_s": 1.0}
    code, out, _ = main(capsys, "jobs", "show", str(a))
    assert code == 0 and "succeeded" in out and '"slept_s": 1.0' in out and "history" in out
    code, out, _ = main(capsys, "jobs", "show", str(a), "--json")
    assert [e["state"] for e in json.loads(out)["events"]] == ["queued", "starting", "running", "succeeded"]


def test_jobs_show_names_a_child_closed_without_an_exit_status_gone(db_path, capsys):
    """A lost sweep's engine, killed with its runner, is closed with no return code: it reads
    "gone", never "exit None"."""
    from ddtree.store.jobs import add_process, close_process, end_process

    with open_db(db_path) as db:
        job = create_job(db, "sleep", {"seconds": 1.0, "fail": False, "message": ""})
        lost = add_process(db, job, name="engine-0-0", argv=["x"], pid=4242, pid_started=None, log_path="a.log")
        close_process(db, lost)
        ended = add_process(db, job, name="engine-0-1", argv=["x"], pid=4243, pid_started=None, log_path="b.log")
        end_process(db, ended, 0)
    code, out, _ = main(capsys, "jobs", "show", str(job))
    assert code == 0 and "None" not in out
    assert "pid 4242     gone" in out and "pid 4243     exit 0" in out


def test_bad_input_is_one_line_exit_2(db_path, capsys):
    with open_db(db_path) as db:
        a = create_job(db, "sleep", {})
        set_state(db, a, "starting")
        set_state(db, a, "running")
        set_state(db, a, "succeeded")
        os.unlink(get_job(db, a).log_path)
    cases = [
        (["jobs", "cancel", "999"], "error: no job with id 999"),
        (["jobs", "cancel", str(a)], f"error: job {a} already succeeded"),
        (["jobs", "show", "999"], "error: no job with id 999"),
        (["jobs", "logs", "999"], "error: no job with id 999"),
        (["jobs", "logs", str(a), "--process", "server"], f"error: job {a} has no process named 'server'"),
        # its runner never wrote a log: the same answer with or without --follow, and no "yet"
        (["jobs", "logs", str(a)], f"error: job {a} has no log (succeeded; no file at "),
        (["jobs", "logs", str(a), "--follow"], f"error: job {a} has no log (succeeded; no file at "),
        (["jobs", "submit", "nope"], "error: unknown job kind 'nope'"),
        (["jobs", "submit", "sleep", "--spec", "{bad"], "error: --spec is not valid JSON"),
        (["jobs", "submit", "sleep", "--spec", '{"seconds": -1}'], "error: sleep seconds must be"),
    ]
    for argv, expected in cases:
        code, out, err = main(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.startswith(expected), (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_database_paths(tmp_path, capsys):
    garbage = tmp_path / "notdb.db"
    garbage.write_bytes(b"\x00\x01not a database at all" * 100)
    before = garbage.read_bytes()
    code, _, err = main(capsys, "--db", str(garbage), "jobs")
    assert code == 2 and err.startswith(f"error: {garbage} is not a SQLite database (")
    assert garbage.read_bytes() == before
    (tmp_path / "afile").write_text("")
    code, _, err = main(capsys, "jobs", "submit", "sleep", "--db", str(tmp_path / "afile" / "x.db"))
    assert code == 2 and "not a folder" in err
    parent = "/sys" if os.geteuid() == 0 else "/"
    code, _, err = main(capsys, "jobs", "submit", "sleep", "--db", os.path.join(parent, "missing-dir", "x.db"))
    assert code == 2 and err.startswith("error: cannot create folder") and "--db" in err


@pytest.mark.parametrize("argv", [["runs"], ["jobs"], ["jobs", "show", "1"], ["jobs", "logs", "1"], ["export", "1"],
                                  ["jobs", "cancel", "1"], ["sweep", "--resume", "1"], ["sweep", "--settle", "1"]])
def test_read_commands_refuse_a_store_that_is_not_there(tmp_path, capsys, argv):
    # a typo in --db must not be answered from a new, empty store left behind
    path = tmp_path / "typo" / "x.db"
    code, out, err = main(capsys, "--db", str(path), *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"error: no store at {path} (") and err.count("\n") == 1
    assert not (tmp_path / "typo").exists()


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs folder and the call that remounts it read-only (root only)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make read-only storage")
    try:
        yield folder, lambda: subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def read_only_mount(tmpfs):
    """A folder on a read-only tmpfs, with a store holding one run and one job (root only)."""
    folder, remount_read_only = tmpfs
    path = folder / "ddtree.db"
    with open_db(path) as db:
        insert_row(db, "runs", {"name": "kept", "engine_kind": "builtin", "state": "done", "created_at": 1.0})
        create_job(db, "sleep", {"seconds": 1.0, "fail": False, "message": ""}, name="nap")
    remount_read_only()
    return path


def test_a_read_only_store_whose_wal_holds_changes_is_refused_not_read_stale(tmpfs, tmp_path, capsys):
    """Read without its -shm, a WAL store can only be read as immutable, which skips the -wal: the
    rows still in it would be missing without a word."""
    folder, remount_read_only = tmpfs
    live = tmp_path / "live.db"
    db = open_db(live)
    try:
        db.execute("PRAGMA wal_autocheckpoint = 0")
        insert_row(db, "runs", {"name": "in-the-wal", "engine_kind": "builtin", "state": "done", "created_at": 1.0})
        for name in ("live.db", "live.db-wal"):  # as a backup of a live store would be taken
            (folder / name).write_bytes((tmp_path / name).read_bytes())
    finally:
        db.close()
    remount_read_only()
    code, out, err = main(capsys, "--db", str(folder / "live.db"), "runs")
    assert code == 2 and out == "" and "changes not yet written back" in err and err.count("\n") == 1


def test_read_commands_work_on_read_only_storage(read_only_mount, capsys):
    code, out, err = main(capsys, "--db", str(read_only_mount), "runs")
    assert (code, err) == (0, "") and "kept" in out
    code, out, err = main(capsys, "--db", str(read_only_mount), "jobs")
    assert (code, err) == (0, "") and "nap" in out
    code, out, err = main(capsys, "--db", str(read_only_mount), "jobs", "show", "1")
    assert (code, err) == (0, "") and "nap" in out
    code, out, err = main(capsys, "--db", str(read_only_mount), "export", "1", "--format", "json")
    assert (code, err) == (0, "") and json.loads(out)["run"]["name"] == "kept"


def test_runs_table_filter_and_json(db_path, capsys):
    open_db(db_path).close()
    code, out, _ = main(capsys, "runs")
    assert code == 0 and "no runs yet" in out
    with open_db(db_path) as db:
        insert_row(db, "runs", {"name": "kimi-tp8", "engine_kind": "sglang", "model": "moonshotai/Kimi-K2.6", "state": "done", "points_total": 2, "created_at": 1.0})
        r2 = insert_row(db, "runs", {"name": "demo", "engine_kind": "builtin", "model": "assets/demo/target", "state": "running", "points_total": 3, "created_at": 2.0})
        insert_row(db, "points", {"run_id": r2, "state": "done"})
    code, out, _ = main(capsys, "runs")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "ENGINE", "MODEL", "STATE", "POINTS", "FAILED", "CREATED", "VERDICT"]
    assert lines[1].split()[:6] == [str(r2), "demo", "builtin", "assets/demo/target", "running", "1/3"]
    with open_db(db_path) as db:  # a run recorded without a model ran the demo pair: named as History names it
        insert_row(db, "runs", {"name": "plain", "engine_kind": "builtin", "state": "done", "created_at": 3.0})
    code, out, _ = main(capsys, "runs", "--filter", "plain")
    assert out.splitlines()[1].split()[3] == "demo/target"
    code, out, _ = main(capsys, "runs", "--filter", "kimi")
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["kimi-tp8"]
    code, out, _ = main(capsys, "runs", "--json", "--filter", "DEMO")  # "plain" is shown with the demo pair
    assert [r["name"] for r in json.loads(out)] == ["plain", "demo"]
    for text in ("demo/target", "Demo/Drafter", "target"):  # what the MODEL column shows finds the run
        code, out, _ = main(capsys, "runs", "--json", "--filter", text)
        # ("demo" is a folder .../demo/target, so it holds that text itself)
        assert [r["name"] for r in json.loads(out)] == ["plain"] + ["demo"] * ("arget" in text), text
    code, out, _ = main(capsys, "runs", "--filter", "nothing-like-this")
    assert "no runs match" in out
    # the text is literal: % and _ are not wildcards
    for text in ("kimi_tp8", "k%8", "kimi\\"):
        code, out, _ = main(capsys, "runs", "--filter", text)
        assert code == 0 and "no runs match" in out, text


@pytest.mark.slow
def test_a_detached_job_outlives_the_cli_and_logs_follow_tails_it(db_path, tmp_path):
    env = dict(os.environ, DDTREE_DB=db_path)
    # The job waits while the gate file exists, so it is still running at the read below however
    # slow the box; the test opens the gate once it has seen that.
    gate = tmp_path / "gate"
    gate.touch()
    command = f"for i in 1 2 3; do echo line-$i; done; while [ -e '{gate}' ]; do sleep 0.05; done"
    out = subprocess.run([EXE, "jobs", "submit", "shell", "--spec", json.dumps({"command": command}), "--detach"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    job_id = int(out.stdout.split()[1])
    with open_db(db_path) as db:
        assert not get_job(db, job_id).terminal  # the CLI is gone, the job is not
    gate.unlink()
    follow = subprocess.run([EXE, "jobs", "logs", str(job_id), "--follow"], capture_output=True, text=True, env=env, timeout=30)
    assert follow.returncode == 0
    # it followed the job to its end: the child's exit, then the final state as the last line
    lines = follow.stdout.splitlines()
    assert any("command exited with 0" in line for line in lines[:-1])
    assert "succeeded" in follow.stdout.splitlines()[-1]
    child = subprocess.run([EXE, "jobs", "logs", str(job_id), "--process", "shell"], capture_output=True, text=True, env=env, timeout=30)
    assert child.stdout.split() == ["line-1", "line-2", "line-3"]
    assert wait(db_path, job_id, timeout=5).state == "succeeded"


def test_cancel_from_the_cli(db_path, capsys):
    code, out, _ = main(capsys, "jobs", "submit", "sleep", "--spec", '{"seconds": 60}', "--detach")
    job_id = int(out.split()[1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with open_db(db_path) as db:
            if get_job(db, job_id).state == "running":
                break
        time.sleep(0.05)
    code, out, err = main(capsys, "jobs", "cancel", str(job_id), "--grace", "5")
    assert code == 0 and out.strip() == f"job {job_id} cancelled"


def test_foreground_submit_reports_the_outcome(db_path, capsys):
    code, out, err = main(capsys, "jobs", "submit", "sleep", "--spec", '{"seconds": 0, "fail": true, "message": "nope"}')
    # the failure is one line, on stderr only
    assert code == 1 and out == "" and err.endswith(" failed: RuntimeError: nope\n") and err.count("\n") == 1
    assert err.startswith("error: job ")
    code, out, err = main(capsys, "jobs", "submit", "sleep", "--spec", '{"seconds": 0}')
    assert code == 0 and out.endswith(" succeeded\n") and err == ""
    code, out, _ = main(capsys, "jobs", "submit", "sleep", "--spec", '{"seconds": 0}', "--json")
    assert code == 0 and json.loads(out)["state"] == "succeeded"


def test_missing_command_module_is_a_stand_in(capsys):
    stand_in = cli.load_command("nonexistent")
    assert isinstance(stand_in, cli._Unavailable)
    assert stand_in.run(None) == 1
    assert capsys.readouterr().err.startswith("error: the nonexistent command cannot load in this installation (")


def test_console_without_a_terminal_is_refused(db_path):
    out = subprocess.run([EXE], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    assert out.returncode == 2
    assert out.stderr.startswith("error: the console needs a terminal")


def test_a_command_imports_only_its_own_module(tmp_path):
    """`ddtree-console jobs` must not pay for the sweep planner, numpy or the hardware view."""
    code = ("import sys; from ddtree.console import cli; cli.main(['--db', sys.argv[1], 'jobs', '--json']);"
            "print(sorted(m for m in sys.modules if m.startswith('ddtree.console.commands.')))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.db")], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "['ddtree.console.commands.jobs']"
