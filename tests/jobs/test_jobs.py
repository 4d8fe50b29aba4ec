import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ddtree.jobs import cancel, reconcile, set_state, submit, wait
from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import BadSpec, JobStateError, UnknownKind
from ddtree.jobs.model import CANCELLED_REASON, create_job
from ddtree.jobs.procs import group_exists, is_alive
from ddtree.jobs.runner import run_job
from ddtree.store import open_db
from ddtree.store.errors import NotFound
from ddtree.store.queries import get_job, job_events, job_processes, list_jobs

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "data" / "ddtree.db")


def job(db_path, job_id):
    with open_db(db_path) as db:
        return get_job(db, job_id)


def events(db_path, job_id):
    with open_db(db_path) as db:
        return [e.state for e in job_events(db, job_id)]


def processes(db_path, job_id):
    with open_db(db_path) as db:
        return job_processes(db, job_id)


def wait_state(db_path, job_id, states, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = job(db_path, job_id)
        if j.state in states:
            return j
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} stayed {j.state}, wanted {states}")


def wait_processes(db_path, job_id, n=1, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = processes(db_path, job_id)
        if len(procs) >= n:
            return procs
        time.sleep(0.05)
    raise AssertionError("child process never recorded")


def test_detached_sleep_job_succeeds_with_result_progress_and_events(db_path):
    # submit detaches: it returns while a long job is still going (order, not seconds)
    long_id = submit(db_path, "sleep", {"seconds": 60}, name="long")
    assert job(db_path, long_id).state not in ("succeeded", "failed")
    cancel(db_path, long_id, grace_s=2.0)
    job_id = submit(db_path, "sleep", {"seconds": 0.5}, name="nap")
    j = wait(db_path, job_id, timeout=20)
    assert j.state == "succeeded", j.error
    assert j.name == "nap" and j.result["slept_s"] >= 0.5
    assert j.progress_done == j.progress_total == 0.5
    assert j.pid and j.pid != os.getpid() and j.heartbeat_at and j.ended_at >= j.started_at
    assert events(db_path, job_id) == ["queued", "starting", "running", "succeeded"]
    assert "succeeded" in open(j.log_path).read()


@pytest.mark.slow
def test_runner_survives_the_killed_process_that_submitted_it(db_path, tmp_path):
    # The job runs while the gate file exists, so it is still running at the read after the kill
    # however slow the box; the test opens the gate once it has seen that.
    gate = tmp_path / "gate"
    gate.touch()
    command = f"while [ -e '{gate}' ]; do sleep 0.05; done"
    code = textwrap.dedent(
        f"""
        import sys, time
        from ddtree.jobs import submit
        print(submit({db_path!r}, "shell", {{"command": {command!r}}}), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    job_id = int(parent.stdout.readline())
    wait_state(db_path, job_id, {"running"})
    os.killpg(parent.pid, signal.SIGKILL)  # the console (and its whole group) dies mid-job
    parent.wait()
    assert job(db_path, job_id).state == "running"
    gate.unlink()
    j = wait(db_path, job_id, timeout=20)
    assert j.state == "succeeded" and j.result == {"returncode": 0}


def test_kind_exception_fails_the_job_with_error_on_row_and_in_log(db_path):
    job_id = submit(db_path, "sleep", {"seconds": 0, "fail": True, "message": "boom here"})
    j = wait(db_path, job_id, timeout=20)
    assert j.state == "failed"
    assert j.error == "RuntimeError: boom here"
    log = open(j.log_path).read()
    assert "Traceback" in log and "boom here" in log
    assert events(db_path, job_id)[-1] == "failed"


def test_shell_job_child_has_own_group_log_and_exit_code(db_path):
    job_id = submit(db_path, "shell", {"command": "echo out-$FOO; echo err >&2; exit 3", "env": {"FOO": "bar"}})
    j = wait(db_path, job_id, timeout=20)
    assert j.state == "failed" and "status 3" in j.error
    (proc,) = processes(db_path, job_id)
    assert proc.returncode == 3 and proc.ended_at and proc.pgid == proc.pid != j.pid
    assert open(proc.log_path).read().split() == ["out-bar", "err"]
    ok = submit(db_path, "shell", {"argv": ["true"]})
    assert wait(db_path, ok, timeout=20).result == {"returncode": 0}


@pytest.mark.slow
def test_cancel_kills_a_child_that_ignores_sigterm(db_path):
    job_id = submit(db_path, "shell", {"command": "trap '' TERM; sleep 60 & wait; sleep 60"})
    (proc,) = wait_processes(db_path, job_id)
    wait_state(db_path, job_id, {"running"})
    time.sleep(0.3)  # let the shell install its trap
    j = cancel(db_path, job_id, grace_s=2.0)
    assert j.state == "cancelled"
    assert j.error == CANCELLED_REASON  # an ended job's reason, not "cancel requested"
    # Left alone the child ignores SIGTERM and lives 120 s: gone when cancel returns, it was killed.
    assert not is_alive(proc.pid, proc.pid_started)
    assert not group_exists(proc.pgid)  # the backgrounded sleep went with it
    assert events(db_path, job_id)[-1] == "cancelled"
    (proc,) = processes(db_path, job_id)
    assert proc.ended_at is not None


def test_cancel_sigkills_a_runner_that_does_not_respond(db_path):
    job_id = submit(db_path, "shell", {"command": "sleep 60"})
    (proc,) = wait_processes(db_path, job_id)
    runner = wait_state(db_path, job_id, {"running"})
    os.kill(runner.pid, signal.SIGSTOP)  # a hung runner: TERM stays pending
    j = cancel(db_path, job_id, grace_s=0.5)
    assert j.state == "cancelled" and "killed" in j.error
    deadline = time.monotonic() + 5
    while is_alive(runner.pid, runner.pid_started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(runner.pid, runner.pid_started)
    assert not is_alive(proc.pid, proc.pid_started)


def test_cancel_errors_finished_unknown_and_queued(db_path):
    job_id = submit(db_path, "sleep", {"seconds": 0})
    wait(db_path, job_id, timeout=20)
    with pytest.raises(JobStateError) as err:
        cancel(db_path, job_id)
    assert err.value.exit_code == 2 and "already succeeded" in err.value.message
    with pytest.raises(NotFound) as err:
        cancel(db_path, 424242)
    assert err.value.exit_code == 2
    with open_db(db_path) as db:
        queued = create_job(db, "sleep", {"seconds": 5.0, "fail": False, "message": ""})
    assert cancel(db_path, queued).state == "cancelled"
    assert run_job(db_path, queued) == 1  # a runner arriving late does nothing
    assert events(db_path, queued) == ["queued", "cancelled"]


@pytest.mark.slow
def test_sigkilled_runner_becomes_lost_and_nothing_else_is_touched(db_path):
    victim = submit(db_path, "shell", {"command": "sleep 60"})
    bystander = submit(db_path, "sleep", {"seconds": 1.5})
    (proc,) = wait_processes(db_path, victim)
    runner = wait_state(db_path, victim, {"running"})
    kill_runner(runner)
    assert reconcile(db_path, stale_s=600) == []  # heartbeat still fresh: not yet
    assert reconcile(db_path, stale_s=0) == [victim]
    j = job(db_path, victim)
    assert j.state == "lost" and "gone" in j.error
    assert not is_alive(proc.pid, proc.pid_started)  # its orphaned child was stopped too
    assert wait(db_path, bystander, timeout=20).state == "succeeded"
    assert reconcile(db_path, stale_s=0) == []


def kill_runner(runner) -> None:
    """SIGKILL a job's runner and wait (5 s at most) until it is gone."""
    os.kill(runner.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while is_alive(runner.pid, runner.pid_started) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_reconcile_closes_the_engine_rows_of_a_lost_job(db_path):
    victim = submit(db_path, "shell", {"command": "sleep 60"})
    bystander = submit(db_path, "shell", {"command": "sleep 60"})
    wait_processes(db_path, victim)
    runner = wait_state(db_path, victim, {"running"})
    wait_state(db_path, bystander, {"running"})
    with open_db(db_path) as db:  # the rows a sweep's runner writes for the engines it starts
        for job_id, state in ((victim, "starting"), (victim, "running"), (victim, "failed"), (bystander, "running")):
            db["engines"].insert({"job_id": job_id, "kind": "builtin", "state": state, "created_at": time.time()})
    kill_runner(runner)
    assert reconcile(db_path, stale_s=0) == [victim]
    with open_db(db_path) as db:
        rows = db.execute("SELECT job_id, state, ended_at IS NOT NULL, error FROM engines ORDER BY id").fetchall()
    assert [r[:3] for r in rows] == [(victim, "lost", 1), (victim, "lost", 1), (victim, "failed", 0),
                                     (bystander, "running", 0)]
    assert "gone" in rows[0][3]
    cancel(db_path, bystander, grace_s=5)
    with open_db(db_path) as db:
        assert db.execute("SELECT state FROM engines WHERE job_id = ?", [bystander]).fetchone()[0] == "stopped"


def test_reconcile_closes_the_download_rows_of_a_lost_job(db_path):
    """A download whose runner was killed showed `running` at its last rate in the Downloads
    pane for ever, while the job itself read `lost`."""
    from ddtree.store.downloads import create_download, recent_downloads, update_download

    victim = submit(db_path, "shell", {"command": "sleep 60"})
    wait_processes(db_path, victim)
    runner = wait_state(db_path, victim, {"running"})
    with open_db(db_path) as db:  # the row a download's runner writes, left mid-way
        row = create_download(db, victim, repo_id="acme/big", revision=None, include=[], local_dir=None)
        update_download(db, row, {"state": "running", "bytes_done": 5, "bytes_total": 10, "rate_bps": 4e6, "eta_s": 9.0})
    kill_runner(runner)
    assert reconcile(db_path, stale_s=0) == [victim]
    with open_db(db_path) as db:
        (got,) = recent_downloads(db, 5)
    assert got["state"] == "lost" and "gone" in got["error"] and got["ended_at"] is not None
    assert got["bytes_done"] == 5  # what had arrived stays on record


def test_reconcile_closes_download_rows_an_ended_job_left_open(db_path):
    """Rows an earlier version left `running` under a cancelled job (its runner gave up waiting on
    the files in flight) stayed so in the Downloads pane: reconcile closes them with the job's state."""
    from ddtree.store.downloads import create_download, recent_downloads, update_download

    with open_db(db_path) as db:
        ended = create_job(db, "sleep", {"seconds": 5.0, "fail": False, "message": ""})
        row = create_download(db, ended, repo_id="acme/big", revision=None, include=[], local_dir=None)
        update_download(db, row, {"state": "running", "rate_bps": 4e6, "eta_s": 9.0})
    assert cancel(db_path, ended).state == "cancelled"
    reconcile(db_path)
    with open_db(db_path) as db:
        (got,) = recent_downloads(db, 5)
    assert (got["state"], got["rate_bps"], got["eta_s"]) == ("cancelled", None, None) and got["ended_at"]


def test_foreground_job_is_cancelled_by_ctrl_c(db_path):
    code = textwrap.dedent(
        f"""
        from ddtree.jobs import submit
        print(submit({db_path!r}, "sleep", {{"seconds": 30}}, detach=False))
        """
    )
    fg = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with open_db(db_path) as db:
            jobs = list_jobs(db)
        if jobs and jobs[0].state == "running":
            break
        time.sleep(0.05)
    fg.send_signal(signal.SIGINT)
    out, _ = fg.communicate(timeout=20)
    j = job(db_path, int(out))
    assert j.state == "cancelled" and j.pgid is None and j.pid == fg.pid


def test_bad_specs_write_nothing(db_path):
    with pytest.raises(UnknownKind) as err:
        submit(db_path, "nope", {})
    assert err.value.exit_code == 2 and "sleep" in err.value.hint
    with pytest.raises(UnknownKind):
        submit(db_path, "../etc", {})
    with pytest.raises(BadSpec):
        submit(db_path, "sleep", {"seconds": "soon"})
    with pytest.raises(BadSpec):
        submit(db_path, "sleep", {"sconds": 1})
    with pytest.raises(BadSpec):
        submit(db_path, "shell", {"command": ""})
    with pytest.raises(BadSpec):
        submit(db_path, "shell", {"argv": "ls"})
    with open_db(db_path) as db:
        assert list_jobs(db) == []


def test_set_state_enforces_the_lifecycle(db_path):
    with open_db(db_path) as db:
        job_id = create_job(db, "sleep", {})
        with pytest.raises(JobStateError):
            set_state(db, job_id, "succeeded")
        with pytest.raises(JobStateError):
            set_state(db, job_id, "sleeping")
        assert get_job(db, job_id).state == "queued"
        set_state(db, job_id, "starting")
        set_state(db, job_id, "running", "go")
        j = set_state(db, job_id, "failed", "it broke")
        assert j.error == "it broke" and j.ended_at
        with pytest.raises(JobStateError):
            set_state(db, job_id, "running")
        evs = job_events(db, job_id)
        assert [(e.state, e.message) for e in evs][1:] == [("starting", None), ("running", "go"), ("failed", "it broke")]


def test_context_spawn_and_close_stop_children(db_path):
    with open_db(db_path) as db:
        job_id = create_job(db, "sleep", {})
    ctx = JobContext(job_id, db_path)
    quick = ctx.spawn([sys.executable, "-c", "import os; print(os.environ['X'])"], env={"X": "42"}, name="quick")
    quick.wait()
    slow = ctx.spawn(["sleep", "30"], name="slow")
    assert os.getpgid(slow.pid) == slow.pid != os.getpgid(0)
    ctx.progress(1, 4, "a quarter")
    ctx.close(grace_s=1.0)
    assert slow.returncode == -signal.SIGTERM
    rows = {p.name: p for p in processes(db_path, job_id)}
    assert rows["quick"].returncode == 0 and rows["slow"].returncode == -signal.SIGTERM
    assert open(rows["quick"].log_path).read().strip() == "42"
    j = job(db_path, job_id)
    assert (j.progress_done, j.progress_total, j.progress_message) == (1.0, 4.0, "a quarter")
    ctx2 = JobContext(job_id, db_path)
    ctx2.cancelled.set()
    with pytest.raises(Exception, match="cancelled"):
        ctx2.spawn(["true"], name="never")
    ctx2.close()


def test_engine_spec_validates_the_backend(tmp_path):
    from ddtree.jobs.kinds.engine import server_argv, validate
    from ddtree.jobs.recipe import RecipeError

    (tmp_path / "t").mkdir()
    base = {"model": str(tmp_path / "t"), "algorithm": "ar"}
    assert validate(base)["backend"] == "auto"
    spec = validate({**base, "backend": "transformers"})
    argv = server_argv(spec)
    assert argv[argv.index("--backend") + 1] == "transformers"
    with pytest.raises(RecipeError, match=r"engine.backend = 'bogus' is not allowed \(allowed: auto, fast, transformers"):
        validate({**base, "backend": "bogus"})
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    with pytest.raises(RecipeError, match='engine.backend applies to kind = "builtin" only'):
        validate({**base, "kind": "sglang", "python": str(python), "backend": "fast"})


FAKE_BUILTIN = """#!{python}
# Stands in for the builtin server: records its argv, prints warm-up steps, then the announcement.
import json, sys, time
open({argv_path!r}, "w").write(json.dumps(sys.argv[1:]))
print(json.dumps({{"event": "warmup", "message": "captured CUDA graphs for session slot 1/4 (listening soon)"}}), flush=True)
print(json.dumps({{"event": "listening", "host": "127.0.0.1", "port": 9, "url": "http://127.0.0.1:9", "backend": "fast"}}), flush=True)
time.sleep(120)
"""


def test_engine_job_skips_warm_up_lines_and_records_the_chosen_backend(db_path, tmp_path):
    (tmp_path / "t").mkdir()
    python = tmp_path / "fake-python"
    python.write_text(FAKE_BUILTIN.format(python=sys.executable, argv_path=str(tmp_path / "argv.json")))
    python.chmod(0o755)
    job_id = submit(db_path, "engine", {"model": str(tmp_path / "t"), "algorithm": "ar", "python": str(python),
                                        "backend": "auto", "ready_timeout_s": 30}, detach=True)
    deadline = time.monotonic() + 30
    row = None
    while time.monotonic() < deadline:
        with open_db(db_path) as db:
            row = db.execute("SELECT state, base_url, backend FROM engines WHERE job_id = ?", [job_id]).fetchone()
        if row and row[0] != "starting":
            break
        time.sleep(0.05)
    try:
        assert tuple(row) == ("running", "http://127.0.0.1:9", "fast")
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[argv.index("--backend") + 1] == "auto"
    finally:
        cancel(db_path, job_id, grace_s=5)
    with open_db(db_path) as db:
        assert db.execute("SELECT state, backend FROM engines WHERE job_id = ?", [job_id]).fetchone() == \
            ("stopped", "fast")
