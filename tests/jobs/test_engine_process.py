"""jobs/engine_process.py: one engine server under a job context, with stand-in servers (real
subprocesses, no HTTP unless the test needs it): located, classified when it fails, cancellable
while it is waited for, and its `engines` row from starting to its end."""

import sys
import threading

import pytest

from ddtree.engine.serving.launch import LaunchSpec, free_port
from ddtree.jobs.context import JobContext
from ddtree.jobs.engine_process import EngineProcess, EngineStartFailed
from ddtree.jobs.errors import JobCancelled
from ddtree.jobs.model import create_job
from ddtree.store import open_db

pytestmark = pytest.mark.timeout(120)

ANNOUNCES = """import json, time
print(json.dumps({"event": "warmup", "message": "listening soon"}), flush=True)
print(json.dumps({"event": "listening", "port": 9, "url": "http://127.0.0.1:9", "backend": "fast"}), flush=True)
time.sleep(120)
"""
OOM = "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB', flush=True); raise SystemExit(1)"
SILENT = "import time; time.sleep(120)"


@pytest.fixture
def ctx(tmp_path):
    db_path = str(tmp_path / "data" / "ddtree.db")
    with open_db(db_path) as db:
        job_id = create_job(db, "sleep", {})
    context = JobContext(job_id, db_path)
    yield context
    context.close(grace_s=1.0)


def server(ctx, code: str, *, announces: bool = True, timeout_s: float = 60.0) -> EngineProcess:
    port = 0 if announces else free_port()
    spec = LaunchSpec(kind="builtin" if announces else "sglang", argv=(sys.executable, "-c", code), port=port,
                      announces_url=announces)
    return EngineProcess(ctx, spec, name="server", ready_timeout_s=timeout_s,
                         row={"job_id": ctx.job_id, "kind": spec.kind, "model": "m"})


def row(ctx, engine: EngineProcess) -> dict:
    return next(ctx.db["engines"].rows_where("id = ?", [engine.row_id]))


def test_an_announcing_server_is_located_and_its_row_follows_it(ctx):
    engine = server(ctx, ANNOUNCES)
    engine.start()
    assert row(ctx, engine)["state"] == "starting" and row(ctx, engine)["pid"] == engine.proc.pid
    assert engine.wait_ready(health=False) == "http://127.0.0.1:9"
    got = row(ctx, engine)
    assert (got["state"], got["base_url"], got["port"], got["backend"]) == ("running", "http://127.0.0.1:9", 9, "fast")
    assert engine.exited() is None
    engine.stop()
    assert engine.proc.returncode is not None and row(ctx, engine)["state"] == "stopped"


def test_a_server_that_exits_while_starting_fails_with_the_cause_from_its_log(ctx):
    engine = server(ctx, OOM)
    engine.start()
    with pytest.raises(EngineStartFailed) as info:
        engine.wait_ready()
    assert info.value.code == "cuda_oom" and "out of memory" in str(info.value)
    engine.stop()  # the start's cause stays on the row
    got = row(ctx, engine)
    assert got["state"] == "failed" and "out of memory" in got["error"]


def test_a_server_that_never_announces_times_out_in_one_line(ctx):
    engine = server(ctx, SILENT, timeout_s=1.0)
    engine.start()
    with pytest.raises(EngineStartFailed, match="did not report a listening address within 1s") as info:
        engine.wait_ready()
    assert "\n" not in str(info.value)
    engine.stop()
    assert row(ctx, engine)["state"] == "failed"


@pytest.mark.parametrize("announces", [True, False], ids=["locating", "health"])
def test_a_cancel_ends_the_wait(ctx, announces):
    # Ready timeout 60 s: had the wait not seen the cancel, it would end in EngineStartFailed instead.
    engine = server(ctx, SILENT, announces=announces, timeout_s=60.0)
    engine.start()
    timer = threading.Timer(0.3, ctx.cancelled.set)
    timer.start()
    try:
        with pytest.raises(JobCancelled):
            engine.wait_ready()
    finally:
        timer.cancel()
    engine.stop("stopped")
    assert row(ctx, engine)["state"] == "stopped"


def test_a_server_that_dies_is_recorded_failed_on_stop(ctx):
    engine = server(ctx, ANNOUNCES.replace("time.sleep(120)", "raise SystemExit(3)"))
    engine.start()
    engine.wait_ready(health=False)
    engine.proc.wait(timeout=30)
    assert engine.died_reason().startswith("exit code 3")
    engine.stop()
    got = row(ctx, engine)
    assert got["state"] == "failed" and got["error"].startswith("exit code 3")
