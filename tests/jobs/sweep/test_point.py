"""jobs/point.py's GPU watch: while a point runs, the sampler hands its samples to the store's
telemetry writer (labelled with the job and the point), and the point's means are read back."""

import time

import pytest

from ddtree.engine.machine import hw
from ddtree.jobs.context import JobContext
from ddtree.jobs.model import create_job
from ddtree.jobs.point import _GpuWatch
from ddtree.store import open_db

from .test_contention import _fake_nvml

pytestmark = pytest.mark.timeout(60)


def test_the_gpu_watch_writes_labelled_samples_and_averages_them(tmp_path, monkeypatch):
    fake = _fake_nvml()
    monkeypatch.setattr(hw, "_default", hw.Nvml(fake.FakeNvml(fake.load_fixture())))
    db_path = str(tmp_path / "ddtree.db")
    with open_db(db_path) as db:
        job_id = create_job(db, "sweep", {})
    ctx = JobContext(job_id, db_path)
    try:
        with _GpuWatch(ctx, 7, (0,)) as gpu:
            polls = 600  # waits of 0.05 s: a bound for a loaded box, not a speed claim
            while not ctx.db.execute("SELECT count(*) FROM telemetry").fetchone()[0]:
                polls -= 1
                assert polls > 0, "no sample reached the store"
                time.sleep(0.05)
            util, power = gpu.means()
        labels = {tuple(r) for r in ctx.db.execute("SELECT job_id, point_id FROM telemetry")}
        assert labels == {(job_id, 7)}
        assert util is not None and power is not None
    finally:
        ctx.close()
