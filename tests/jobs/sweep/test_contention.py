"""Contention (issue 16): what competed with each sweep point is recorded and flagged.

The judgement is tested on injected readings (so "not contended" never depends on how busy the
test machine is); the end-to-end test is one-sided: a sweep point run beside a CPU hog of our own
must be flagged, in the store and in every export."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree.console import export
from ddtree.engine.machine.contention import (Contention, GpuPressure, OtherProcess, ThresholdError, Thresholds, Watch,
                                      busy_note, busy_reasons)
from ddtree.engine.machine.hw import Nvml, clock_event_names
from ddtree.jobs.plan import box_line
from ddtree.jobs.supervisor import submit
from ddtree.store import sweeps
from ddtree.store.contention import export_fields, record_contention, run_busy_note
from ddtree.store.db import open_db

from .conftest import write_recipe

HOG = "while True:\n    pass\n"


def quiet(**kw) -> Contention:
    base = dict(wall_s=10.0, cpus=2, load1=0.5, load1_start=0.4, cpu_percent=20.0, others_cpu_s=0.2)
    return Contention(**{**base, **kw})


# -- the judgement, on injected readings ---------------------------------------------------------


def test_a_quiet_reading_is_not_contended():
    assert busy_reasons(quiet()) == []
    assert busy_note([]) is None


def test_others_cpu_time_above_a_tenth_of_a_core_is_contended():
    reading = quiet(others_cpu_s=3.0, others_top=(OtherProcess(pid=7, name="hog", cpu_s=3.0),))
    assert reading.others_cores == pytest.approx(0.3)
    assert busy_reasons(reading) == ["others 0.30 cores (top: hog)"]
    assert busy_reasons(reading, Thresholds(others_cores=0.5)) == []


def test_load_above_the_cpu_count_is_contended():
    assert busy_reasons(quiet(load1=5.5)) == ["load 5.5 > 2 cpus"]
    assert busy_reasons(quiet(load1=None, load1_start=None)) == []  # unknown is not busy


def test_other_gpu_processes_and_slowdowns_are_contended_idle_is_not():
    idle = GpuPressure(index=0, clock_events=("gpu_idle", "applications_clocks_setting"))
    assert busy_reasons(quiet(gpus=(idle,))) == []
    hot = GpuPressure(index=1, other_pids=(42,), clock_events=("sw_thermal_slowdown",))
    assert busy_reasons(quiet(gpus=(hot,))) == ["gpu 1: 1 other process", "gpu 1: sw_thermal_slowdown"]


def test_thresholds_validate():
    with pytest.raises(ThresholdError):
        Thresholds(others_cores=0)
    with pytest.raises(ThresholdError):
        Thresholds(cpu_percent=150)


def test_a_reading_round_trips_through_its_dict():
    reading = quiet(others_top=(OtherProcess(1, "x", 0.5),), gpus=(GpuPressure(0, (3,), 1980, 1980, 51.0,
                                                                               ("gpu_idle",)),))
    again = Contention.from_dict(json.loads(json.dumps(reading.to_dict())))
    assert again == reading


def test_clock_event_bits_are_named():
    assert clock_event_names(0x1 | 0x20) == ("gpu_idle", "sw_thermal_slowdown")
    assert clock_event_names(0) == ()
    assert clock_event_names(0x10000) == ("bit_0x10000",)


# -- GPUs through the one NVML query function (a fake driver) --------------------------------------


def _fake_nvml():
    path = Path(__file__).resolve().parents[2] / "engine" / "machine" / "fake_nvml.py"
    spec = importlib.util.spec_from_file_location("contention_fake_nvml", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_watch_reads_other_gpu_processes_clock_events_and_temperature():
    fake = _fake_nvml()
    fixture = fake.load_fixture()
    fixture["gpus"][0]["processes"] = [{"pid": 1, "used_memory": 1 << 30}]  # init: never ours

    class Driver(fake.FakeNvml):
        def nvmlDeviceGetCurrentClocksEventReasons(self, h):
            return 0x20 if h == 0 else 0x1

    watch = Watch(gpus=(0, 1), session=Nvml(Driver(fixture)))
    reading = watch.start().stop()
    g0, g1 = reading.gpus
    assert g0.other_pids == (1,) and g0.clock_events == ("sw_thermal_slowdown",)
    assert g0.temperature_c == fixture["gpus"][0]["temperature_c"]
    assert g0.clock_sm_mhz == fixture["gpus"][0]["clock_sm_mhz"]
    assert g1.other_pids == () and g1.clock_events == ("gpu_idle",)
    reasons = busy_reasons(reading, Thresholds(others_cores=1e9, load_per_cpu=1e9))
    assert reasons == ["gpu 0: 1 other process", "gpu 0: sw_thermal_slowdown"]


def test_an_old_driver_answers_by_the_throttle_name_and_a_missing_query_says_why():
    fake = _fake_nvml()

    class OldDriver(fake.FakeNvml):
        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            return 0x4

    old = Watch(gpus=(0,), session=Nvml(OldDriver(fake.load_fixture()))).start().stop()
    assert old.gpus[0].clock_events == ("sw_power_cap",)
    bare = Watch(gpus=(0,), session=Nvml(fake.FakeNvml(fake.load_fixture()))).start().stop()
    assert bare.gpus[0].clock_events is None and "missing" in bare.gpus[0].unavailable["clock_events"]


def test_without_nvml_gpus_are_none_with_the_reason():
    fake = _fake_nvml()
    import pynvml

    session = Nvml(fake.FakeNvml(fake.load_fixture(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    reading = Watch(gpus=(0,), session=session).start().stop()
    assert reading.gpus == () and "NVML library not found" in reading.gpu_reason
    assert Watch().start().stop().gpu_reason == "the point uses no GPU"


# -- our own processes are not others --------------------------------------------------------------


def test_a_process_group_named_ours_is_not_counted():
    hog = subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True)
    try:
        watch = Watch(our_pgids=(hog.pid,)).start()
        while hog_cpu(hog.pid) < 0.3:  # CPU time, not wall time: the hog has really run
            pass
        reading = watch.stop()
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
    assert all(p.pid != hog.pid for p in reading.others_top)


def hog_cpu(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


# -- the store, the exports and the dry-run line -------------------------------------------------------


def test_busy_line_in_the_dry_run():
    assert box_line({"busy": True, "note": "busy box: load 5.5 > 2 cpus"}).startswith("warning: busy box: load 5.5")
    assert box_line({"busy": False, "note": "the box is quiet now"}) == "box: the box is quiet now"


def test_export_fields_of_a_point_without_a_reading_are_none():
    point = SimpleNamespace(contention=None, contended=None)
    assert set(export_fields(point).values()) == {None}
    assert run_busy_note([point]) is None


# -- end to end: a real sweep point beside a CPU hog ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_point_run_under_a_cpu_hog_is_flagged_in_store_pane_and_exports(tmp_path, tiny_pair, prompts_file):
    from ddtree.console.screens.sweeps import point_cells
    from ddtree.jobs.recipe import load_recipe, recipe_to_dict

    # one DDTree point and its AR baseline
    recipe_path = write_recipe(tmp_path / "tiny.toml", tiny_pair, prompts_file, budget=[2], concurrency=[1],
                               num_prompts=6, warmup=0, repeats=1)
    recipe = recipe_to_dict(load_recipe(recipe_path))
    db_path = tmp_path / "ddtree.db"
    hog = subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True)  # its own group: not ours
    try:
        job_id = submit(db_path, "sweep", {"recipe": recipe}, detach=False)
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
    db = open_db(db_path)
    run_id = db.execute("SELECT id FROM runs WHERE job_id = ?", [job_id]).fetchone()[0]
    run_row = sweeps.get_run(db, run_id)
    points = sweeps.list_points(db, run_id)
    db.close()
    assert [p.state for p in points] == ["done", "done"]
    for point in points:
        assert point.contended == 1
        assert any(r.startswith("others ") for r in point.contention["reasons"])
        assert point.contention["others_cores"] > 0.1
        assert "busy box" in str(point_cells(point)[-1])  # the pane's NOTE cell
    assert run_busy_note(points).startswith("busy box: 2/2 points")  # the pane's header note
    # the exports
    md = export.render(run_row, points, "md")
    assert "**warning: busy box: 2/2 points" in md and "## Contention" in md
    assert md.count("busy box (1/1 repeats)") == 2  # each cell's note in the main table
    rows = list(csv.DictReader(io.StringIO(export.render(run_row, points, "csv"))))
    assert [r["contended"] for r in rows] == ["1", "1"] and all("others" in r["busy_reasons"] for r in rows)
    assert all(float(r["others_cpu_cores"]) > 0.1 for r in rows)
    data = json.loads(export.render(run_row, points, "json"))
    assert data["busy_box"].startswith("busy box") and [p["contended"] for p in data["points"]] == [True, True]


def test_record_contention_stores_the_reading_and_the_flag(tmp_path, tiny_pair, prompts_file):
    from ddtree.jobs.recipe import load_recipe, recipe_to_dict

    db = open_db(tmp_path / "ddtree.db")
    recipe = recipe_to_dict(load_recipe(write_recipe(tmp_path / "r.toml", tiny_pair, prompts_file)))
    run_id = sweeps.create_run(db, job_id=None, name="r", recipe=recipe)
    ids = sweeps.ensure_points(db, run_id, [{"point_key": json.dumps({"budget": b, "repeat": 0}), "idx": i,
                                            "algorithm": "ddtree", "budget": b, "repeat": 0}
                                           for i, b in enumerate((2, 4))])
    reading = quiet(load1=5.5, gpus=(GpuPressure(0, (9,), 1400, 1980, 83.0, ("hw_slowdown",)),))
    record_contention(db, ids[json.dumps({"budget": 2, "repeat": 0})], reading.to_dict(), busy_reasons(reading))
    record_contention(db, ids[json.dumps({"budget": 4, "repeat": 0})], quiet().to_dict(), [])
    busy, calm = sweeps.list_points(db, run_id)
    db.close()
    assert (busy.contended, calm.contended) == (1, 0)
    fields = export_fields(busy)
    assert fields["contended"] is True and fields["host_load1"] == 5.5
    assert fields["gpu_other_processes"] == 1 and fields["gpu_clock_events"] == "hw_slowdown"
    assert fields["gpu_temperature_c"] == 83.0
    assert export_fields(calm)["contended"] is False and export_fields(calm)["busy_reasons"] is None
    assert run_busy_note([busy, calm]) == "busy box: 1/2 points, load 5.5, others 0.02 cores"
