"""The store's named statements for jobs, downloads, telemetry and the console's poll: what each
writes and reads, and that the steps of a larger write refuse to commit on their own."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from ddtree.store import open_db, transaction
from ddtree.store import jobs as store_jobs
from ddtree.store.db import data_version, db_file
from ddtree.store.downloads import create_download, download_of_runner, recent_downloads, update_download
from ddtree.store.errors import StoreError
from ddtree.store.queries import get_job, insert_row, job_events, job_processes, recent_engines, runs_signature
from ddtree.store.telemetry import TelemetryWriter


@pytest.fixture
def db(tmp_path):
    with open_db(tmp_path / "d.db") as conn:
        yield conn


def _job(db) -> int:
    with transaction(db):
        job_id = store_jobs.insert_job(db, kind="sleep", name="nap", spec_json="{}", host="here", at=5.0)
        store_jobs.add_job_event(db, job_id, at=5.0, state="queued", message="submitted sleep")
    return job_id


def test_the_steps_of_a_larger_write_run_only_inside_its_transaction(db):
    job_id = _job(db)
    assert get_job(db, job_id).state == "queued" and [e.state for e in job_events(db, job_id)] == ["queued"]
    for step in (lambda: store_jobs.update_job(db, job_id, {"state": "running"}),
                 lambda: store_jobs.add_job_event(db, job_id, at=6.0, state="running", message=None),
                 lambda: store_jobs.set_job_log_path(db, job_id, "/x.log"),
                 lambda: store_jobs.insert_job(db, kind="sleep", name=None, spec_json="{}", host="h", at=1.0)):
        with pytest.raises(StoreError, match="inside transaction"):
            step()
    assert get_job(db, job_id).state == "queued" and len(job_events(db, job_id)) == 1


def test_runner_heartbeat_and_cancel_columns(db):
    job_id = _job(db)
    store_jobs.record_runner(db, job_id, pid=4242, pgid=None, pid_started=1.5, host="box")
    job = get_job(db, job_id)
    assert (job.pid, job.pgid, job.pid_started, job.host) == (4242, None, 1.5, "box") and job.heartbeat_at
    assert store_jobs.cancel_request(db, job_id) is None and store_jobs.cancel_grace(db, job_id) is None
    store_jobs.request_cancel(db, job_id, 3)
    at, grace = store_jobs.cancel_request(db, job_id)
    assert at > 0 and grace == 3.0 and store_jobs.cancel_grace(db, job_id) == 3.0
    store_jobs.set_progress(db, job_id, progress_done=2, progress_message="half")
    store_jobs.set_progress(db, job_id, progress_total=4)  # the others keep their value
    job = get_job(db, job_id)
    assert (job.progress_done, job.progress_total, job.progress_message) == (2, 4, "half")


def test_process_rows_close_once(db):
    job_id = _job(db)
    proc = store_jobs.add_process(db, job_id, name="engine", argv=["python", "-m", "x"], pid=77,
                                  pid_started=2.0, log_path="/tmp/l.log")
    assert [p.id for p in job_processes(db, job_id, running_only=True)] == [proc]
    store_jobs.end_process(db, proc, 0)
    ended = job_processes(db, job_id)[0].ended_at
    store_jobs.close_process(db, proc)  # already closed: its time stays
    assert job_processes(db, job_id)[0].ended_at == ended and not job_processes(db, job_id, running_only=True)


def test_download_rows_and_the_row_of_a_foreground_runner(db):
    job_id = _job(db)
    store_jobs.record_runner(db, job_id, pid=999, pgid=None, pid_started=None, host="box")
    row_id = create_download(db, job_id, repo_id="acme/m", revision=None, include=["*.json"], local_dir=None)
    first = recent_downloads(db, 10)[0]
    assert first["state"] == "planning" and first["include"] == '["*.json"]'
    update_download(db, row_id, {"state": "running", "bytes_done": 5})
    row = download_of_runner(db, 999, since=0.0)
    assert row["id"] == row_id and row["bytes_done"] == 5 and row["updated_at"] >= first["updated_at"]
    assert download_of_runner(db, 1000, since=0.0) is None
    assert download_of_runner(db, 999, since=row["created_at"] + 1) is None


def test_poll_reads_see_a_commit_of_another_connection(db):
    version, sig = data_version(db), runs_signature(db)
    assert recent_engines(db, 5) == []
    with open_db(db_file(db)) as other:
        insert_row(other, "runs", {"name": "r", "created_at": 1.0})
        insert_row(other, "engines", {"kind": "builtin", "state": "running"})
    assert data_version(db) != version and runs_signature(db) != sig
    assert [e["state"] for e in recent_engines(db, 5)] == ["running"]


@dataclass
class _Gpu:
    index: int
    util: float | None = 50.0
    mem_used: int | None = 1
    mem_total: int | None = 2
    power_w: float | None = 300.0
    temperature_c: float | None = 40.0


@dataclass
class _Sample:
    at: float
    gpus: list = field(default_factory=list)


def test_telemetry_writer_labels_rows_and_prunes_past_the_retention(db):
    writer = TelemetryWriter(db, labels={"job_id": 3}, retention_s=100)
    assert writer(_Sample(at=1000.0, gpus=[_Gpu(0), _Gpu(1)])) == 2
    assert writer(_Sample(at=1200.0, gpus=[_Gpu(0)])) == 1  # a minute on: rows before 1100 go
    rows = list(db["telemetry"].rows)
    assert [(r["at"], r["gpu_index"], r["job_id"], r["temp_c"]) for r in rows] == [(1200.0, 0, 3, 40.0)]
    with pytest.raises(StoreError):
        TelemetryWriter(db, retention_s=0)


def test_downloads_sharing_a_place_are_those_into_the_same_cache_or_folder_of_live_jobs(db, tmp_path):
    from ddtree.store.downloads import open_downloads_of

    def download(cache_dir, local_dir=None, job_state="running"):
        with transaction(db):
            job_id = store_jobs.insert_job(db, kind="download", name="acme/m", host="here", at=5.0,
                                           spec_json=json.dumps({"repo_id": "acme/m", "cache_dir": cache_dir,
                                                                 "local_dir": local_dir}))
        with transaction(db):
            store_jobs.update_job(db, job_id, {"state": job_state})
        create_download(db, job_id, repo_id="acme/m", revision=None, include=[], local_dir=local_dir)
        return job_id

    here, there = download("/c/one"), download("/c/two")
    folder = download(None, local_dir="/m")
    download("/c/one", job_state="lost")  # its runner was killed: its row stayed open, nobody fetches
    assert [r["job_id"] for r in open_downloads_of(db, "acme/m", None, cache_dir="/c/one")] == [here]
    assert [r["job_id"] for r in open_downloads_of(db, "acme/m", None, cache_dir="/c/two")] == [there]
    assert [r["job_id"] for r in open_downloads_of(db, "acme/m", "/m")] == [folder]
    assert open_downloads_of(db, "acme/m", None, cache_dir="/c/one", besides=here) == []
    # One folder by two paths (a symlink) is one place.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    linked = download(None, local_dir=str(tmp_path / "link"))
    assert [r["job_id"] for r in open_downloads_of(db, "acme/m", str(tmp_path / "real"))] == [linked]
    assert "spec_cache_dir" not in open_downloads_of(db, "acme/m", str(tmp_path / "real"))[0]
