"""The `download` job kind through the real supervisor and a detached runner, against the local hub."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddtree.jobs import cancel, submit, wait
from ddtree.jobs.errors import BadSpec
from ddtree.jobs.kinds.download import validate
from ddtree.store.db import open_db

from .conftest import BAD_TOKEN


def _row(db_path, job_id):
    db = open_db(db_path)
    try:
        return next(db["downloads"].rows_where("job_id = ?", [job_id]), None)
    finally:
        db.close()


def test_validate_normalises_and_refuses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = validate({"repo_id": "acme/tiny", "local_dir": "models/x", "include": "*.json"})
    assert out["local_dir"] == str(tmp_path / "models/x") and out["include"] == ["*.json"]
    assert Path(validate({"repo_id": "acme/tiny"})["cache_dir"]).is_absolute()
    for bad in ({}, {"repo_id": "no good"}, {"repo_id": "a/b", "token": "x"}, {"repo_id": "a/b", "include": 3},
                {"repo_id": "a/b", "reserve_bytes": "10"}):
        with pytest.raises(BadSpec) as err:
            validate(bad)
        assert err.value.exit_code == 2


def test_detached_job_downloads_and_records_progress(hub, tmp_path):
    db_path = tmp_path / "ddtree.db"
    spec = {"repo_id": "acme/tiny", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache"), "reserve_bytes": 0}
    job_id = submit(db_path, "download", spec)
    job = wait(db_path, job_id, timeout=60)
    assert job.state == "succeeded", job
    row = _row(db_path, job_id)
    total = sum(map(len, hub.repos["acme/tiny"].files.values()))
    assert row["state"] == "succeeded" and row["bytes_done"] == row["bytes_total"] == total
    assert row["files_done"] == row["files_total"] == 5 and row["reserve_bytes"] == 0
    assert row["disk_free_bytes"] > 0 and row["ended_at"] >= row["created_at"]
    assert job.result["files_fetched"] == 5 and Path(job.result["path"], "config.json").is_file()
    assert job.progress_done == job.progress_total == total


@pytest.mark.slow
def test_cancel_mid_download_then_resume(hub, tmp_path):
    # 16 files of 96 kB, two at a time: about 5 s in all, room for a loaded box between the
    # poll that sees 3 done (the count reaches the store every 0.5 s) and the cancel.
    hub.rate_bps = 150_000
    db_path = tmp_path / "ddtree.db"
    spec = {"repo_id": "acme/many", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache"), "reserve_bytes": 0,
            "max_workers": 2}
    job_id = submit(db_path, "download", spec)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = _row(db_path, job_id)
        if row and (row["files_done"] or 0) >= 3:
            break
        time.sleep(0.05)
    job = cancel(db_path, job_id, grace_s=10)
    assert job.state == "cancelled"
    row = _row(db_path, job_id)
    assert row["state"] == "cancelled" and 3 <= row["files_done"] < 16
    done_before = {p for p in hub.repos["acme/many"].files if hub.gets(p)}
    hub.rate_bps = None
    again = submit(db_path, "download", spec, detach=False)
    job = wait(db_path, again, timeout=60)
    assert job.state == "succeeded"
    assert job.result["files_fetched"] == 16 - _row(db_path, job_id)["files_done"]
    fetched_twice = [p for p in done_before if len(hub.gets(p)) > 1]
    # only files that were mid-flight at the cancel may be fetched again
    assert len(fetched_twice) <= 2


def test_failure_is_one_line_and_the_token_never_lands(hub, tmp_path, monkeypatch, no_token_file):
    monkeypatch.setenv("HF_TOKEN", BAD_TOKEN)
    db_path = tmp_path / "ddtree.db"
    spec = {"repo_id": "acme/gated", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache"), "reserve_bytes": 0}
    job_id = submit(db_path, "download", spec)
    job = wait(db_path, job_id, timeout=60)
    assert job.state == "failed"
    assert "acme/gated is gated" in job.error and "HF_TOKEN environment variable" in job.error
    assert "Traceback" not in Path(job.log_path).read_text()
    assert _row(db_path, job_id)["state"] == "failed"
    for path in [*tmp_path.rglob("*")]:
        if path.is_file():
            assert BAD_TOKEN.encode() not in path.read_bytes(), path


def test_a_cancel_closes_the_row_while_a_chunk_is_still_in_flight(hub, tmp_path, monkeypatch):
    """huggingface_hub reports (and so can be stopped) once per 10 MB chunk. On a slow link the
    runner's grace ran out first: it recorded the job cancelled and exited, and the downloads row
    read `running` with its last rate and ETA for ever."""
    import threading

    from ddtree.engine.machine.download import Download
    from ddtree.jobs.context import JobContext
    from ddtree.jobs.errors import JobCancelled
    from ddtree.jobs.kinds import download as kind
    from ddtree.jobs.model import create_job

    in_flight, release = threading.Event(), threading.Event()

    def slow_chunk(self, path):  # a file whose next chunk has not arrived
        in_flight.set()
        release.wait(60)

    monkeypatch.setattr(Download, "_fetch", slow_chunk)
    db_path = tmp_path / "ddtree.db"
    spec = validate({"repo_id": "acme/tiny", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache"),
                     "reserve_bytes": 0, "max_workers": 1})
    with open_db(db_path) as db:
        job_id = create_job(db, "download", spec)
    ctx = JobContext(job_id, db_path)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_catch(kind.run, ctx, spec)), daemon=True)
    worker.start()
    try:
        assert in_flight.wait(30)
        ctx.cancelled.set()
        deadline = time.monotonic() + 20  # a guard against a hang: the chunk never comes until released
        while _row(db_path, job_id)["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        row = _row(db_path, job_id)
        assert row["state"] == "cancelled" and row["ended_at"] is not None and row["eta_s"] is None
        assert worker.is_alive()  # the file in flight has not noticed yet
        release.set()
        worker.join(30)
        assert isinstance(outcome[0], JobCancelled)
        assert _row(db_path, job_id)["state"] == "cancelled"  # progress after the stop wrote no `running`
    finally:
        release.set()
        worker.join(10)
        ctx.close()


def _catch(fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:  # the test reads what the kind raised
        return exc
