"""A store seeded the way real runs fill it, through the store's and jobs' own write functions."""

from __future__ import annotations

import json
import time

import pytest

from ddtree.jobs.model import create_job, set_state
from ddtree.jobs.plan import make_plan
from ddtree.jobs.recipe import recipe_from_dict, recipe_to_dict
from ddtree.store import open_db, sweeps
from ddtree.store.queries import insert_row, update_row

from ..support.pilot import on_screen, until  # noqa: F401  (the console tests import them from here)

@pytest.fixture
def utc(monkeypatch):
    """Timestamps drawn in UTC, whatever the machine's zone (the snapshots and stamps compare text)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


#: A fixed "now" so ages and uptimes in snapshots do not move.
NOW = 1_790_000_000.0

TAU = {4: 3.1, 8: 3.6, 16: 4.0, 32: 4.3, 64: 4.5}
TOKS_C1 = {4: 61.0, 8: 68.0, 16: 74.0, 32: 77.5, 64: 71.0}

HARDWARE = {"gpus": [{"index": i, "name": "NVIDIA H200", "memory_total": 143_771_000_000, "nvlinks": 18,
                      "pcie_gen_max": 5, "pcie_width_max": 16} for i in range(8)],
            "links": [["X" if i == j else "NV18" for j in range(8)] for i in range(8)], "driver_version": "575.51",
            "host": {"hostname": "gpu-a", "cpu_model": "AMD EPYC 9654", "cpus_logical": 384,
                     "memory_total": 2_200_000_000_000, "numa": [{"node": 0, "cpus": 192}, {"node": 1, "cpus": 192}]}}


def demo_recipe(name: str = "k26-ddtree", budgets=(4, 8, 16, 32, 64), concurrency=(1, 4), model="Qwen/Qwen3-8B"):
    return recipe_from_dict({"name": name,
                             "engine": {"kind": "builtin", "model": model, "draft_model": "z-lab/Qwen3-8B-DFlash-b16"},
                             "sweep": {"budget": list(budgets), "concurrency": list(concurrency), "num_prompts": 32,
                                       "max_new_tokens": 128, "baseline": ["ar", "dflash"]}})


def metrics_for(algorithm: str, budget: int | None, concurrency: int, scale: float = 1.0) -> dict:
    if algorithm == "ar":
        tau, toks = 1.0, 22.0
    elif algorithm == "dflash":
        tau, toks = 2.9, 55.0
    else:
        tau, toks = TAU[budget], TOKS_C1[budget]
    toks = toks * scale * (1.0 if concurrency == 1 else 2.6 - (budget or 0) / 80)
    e2e = 128 / (toks / concurrency)
    return {"requests_ok": 32, "requests_failed": 0, "output_tokens": 4096, "duration_s": 4096 / toks,
            "output_tok_s": toks, "req_s": toks / 128, "tok_s_per_user": toks / concurrency,
            "ttft_p50": 0.05, "ttft_p90": 0.08, "ttft_p99": 0.1, "itl_p50": 1 / toks, "itl_p90": 1.2 / toks,
            "itl_p99": 1.5 / toks, "e2e_p50": e2e, "e2e_p90": e2e * 1.2, "e2e_p99": e2e * 1.4,
            "tau_mean": tau, "tau_weighted": tau * 1.02, "tau_hist": [0, 3, 5, 9, 7, 4, 2]}


def seed_run(db, recipe, *, done: int | None = None, scale: float = 1.0, hardware=HARDWARE, created=NOW - 3600,
             job_id=None, state: str | None = None) -> int:
    plan = make_plan(recipe)
    run_id = sweeps.create_run(db, job_id=job_id, name=recipe.name, recipe=recipe_to_dict(recipe),
                               engine_kind=recipe.engine.kind, model=recipe.engine.model,
                               draft_model=recipe.engine.draft_model, hardware=hardware,
                               software={"python": "3.11.9", "packages": {"torch": "2.13.0", "transformers": "5.24.0"}},
                               points_total=len(plan.points))
    rows = [{**p.params(), "point_key": p.key, "idx": p.index, "baseline": p.baseline, "num_prompts": 32,
             "max_new_tokens": 128} for p in plan.points]
    ids = sweeps.ensure_points(db, run_id, rows)
    for n, p in enumerate(plan.points):
        if done is not None and n >= done:
            break
        m = metrics_for(p.algorithm, p.budget, p.concurrency, scale)
        t0 = created + 60 + n * 30
        reqs = [{"idx": i, "ok": True, "prompt_tokens": 40, "completion_tokens": 128, "ttft_s": 0.05,
                 "itl_mean_s": 0.01, "e2e_s": m["e2e_p50"], "verify_ct": 30, "accept_length": m["tau_mean"],
                 "started_at": t0 + i, "finish_reason": "length"} for i in range(4)]
        sweeps.record_point(db, ids[p.key], state="done", metrics=m, requests=reqs, started_at=t0, ended_at=t0 + 25)
    sweeps.update_derived(db, run_id)
    finished = done is None or done >= len(plan.points)
    update_row(db, "runs", run_id, {"created_at": created, "started_at": created,
                                    "state": state or ("succeeded" if finished else "running"),
                                    "ended_at": created + 1800 if finished else None})
    return run_id


def seed_store(db_path) -> dict:
    """Jobs (one running sweep, a finished download, a running download, an engine), two finished
    runs on different hardware and a half-done live one."""
    ids = {}
    with open_db(db_path) as db:
        old = seed_run(db, demo_recipe("last-week", concurrency=(1,)), created=NOW - 7 * 86400, scale=0.8,
                       hardware={**HARDWARE, "gpus": HARDWARE["gpus"][:4], "links": [["X"]]})
        ids["old_run"] = old
        ids["prev_run"] = seed_run(db, demo_recipe("yesterday", concurrency=(1,)), created=NOW - 86400)
        job = create_job(db, "sweep", {"run_id": 3}, name="k26-ddtree")
        set_state(db, job, "starting")
        set_state(db, job, "running")
        update_row(db, "jobs", job, {"progress_done": 9, "progress_total": 14, "progress_message": "point 10/14",
                                     "started_at": NOW - 600, "heartbeat_at": NOW})
        ids["live_run"] = seed_run(db, demo_recipe(), done=9, created=NOW - 600, job_id=job)
        ids["sweep_job"] = job
        dl = create_job(db, "download", {"repo_id": "Qwen/Qwen3-8B"}, name="Qwen/Qwen3-8B")
        set_state(db, dl, "starting")
        set_state(db, dl, "running")
        update_row(db, "jobs", dl, {"started_at": NOW - 120, "progress_done": 6.1e9, "progress_total": 16.4e9})
        insert_row(db, "downloads", {"job_id": dl, "repo_id": "Qwen/Qwen3-8B", "revision": "main",
                                     "include": json.dumps(["*.safetensors", "*.json"]), "state": "running",
                                     "bytes_total": 16_400_000_000, "bytes_done": 6_100_000_000, "files_total": 12,
                                     "files_done": 4, "rate_bps": 85_000_000, "eta_s": 121, "disk_free_bytes":
                                     412_000_000_000, "reserve_bytes": 50_000_000_000, "created_at": NOW - 120})
        ids["download_job"] = dl
        eng = create_job(db, "engine", {"kind": "builtin", "demo": True}, name="demo-engine")
        set_state(db, eng, "starting")
        set_state(db, eng, "running")
        update_row(db, "jobs", eng, {"started_at": NOW - 900, "progress_message": "serving at http://127.0.0.1:40123"})
        insert_row(db, "engines", {"job_id": eng, "kind": "builtin", "backend": "transformers", "model": "demo",
                                   "draft_model": "demo",
                                   "algorithm": "ddtree", "budget": 32, "tp": 1, "gpus": "[]", "host": "127.0.0.1",
                                   "port": 40123, "base_url": "http://127.0.0.1:40123", "state": "running",
                                   "created_at": NOW - 900, "ready_at": NOW - 880, "log_path": None})
        ids["engine_job"] = eng
    return ids


# -- fixed hardware, so panes and snapshots do not depend on the machine -------------------------

def _fake_nvml_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "engine" / "machine" / "fake_nvml.py"
    spec = importlib.util.spec_from_file_location("cockpit_fake_nvml", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fixed_view(gpus: bool = True):
    from ddtree.engine.machine.hw import GpuView, Nvml

    if not gpus:
        return GpuView(reason="NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on this machine",
                       at=NOW)
    fake = _fake_nvml_module()
    view = Nvml(fake.FakeNvml(fake.load_fixture())).view()
    for g in view.gpus:
        g.processes = []
    view.at = NOW
    return view


def fixed_host():
    from ddtree.engine.machine.host import DiskInfo, HostInfo, NumaNode

    return HostInfo(hostname="gpu-a", cpu_model="AMD EPYC 9654 96-Core Processor", cpus_logical=192,
                    cpus_physical=96, cpu_percent=12.0, load_avg=(3.0, 2.5, 2.0), memory_total=1_540_000_000_000,
                    memory_available=1_200_000_000_000, memory_percent=22.0,
                    numa=[NumaNode(0, list(range(0, 96)), 770_000_000_000, 600_000_000_000, [10, 32]),
                          NumaNode(1, list(range(96, 192)), 770_000_000_000, 600_000_000_000, [32, 10])],
                    disks=[DiskInfo("hf_cache", "/data/hf", "/data", "xfs", 3_840_000_000_000,
                                    2_100_000_000_000, 1_740_000_000_000),
                           DiskInfo("data", "/home/op/.local/share/ddtree-console", "/", "ext4", 480_000_000_000,
                                    120_000_000_000, 360_000_000_000)],
                    affinity=list(range(192)))


def fixed_sample(view):
    from ddtree.engine.machine.sampler import GpuSample, TelemetrySample

    gpus = [GpuSample(index=g.index, util=(37 * g.index) % 100, mem_used=g.memory_total // (g.index + 2),
                      mem_total=g.memory_total, power_w=300.0, temperature_c=50.0, clock_sm_mhz=1900)
            for g in view.gpus]
    return TelemetrySample(at=NOW, gpus=gpus, cpu_percent=10.0, mem_used=1, mem_total=2)


def fixed_sources(gpus: bool = True, healthy: bool = True):
    """Hardware and health that never change, samples at most once (so snapshots are stable)."""
    from ddtree.console.poll import Sources

    view = fixed_view(gpus)
    return Sources(gpu_view=lambda: view, host_info=lambda _folder: fixed_host(),
                   gpu_sample=lambda: fixed_sample(view), health=lambda _url: healthy, now=lambda: NOW,
                   sample_s=1e9, health_s=1e9, hardware_s=1e9)


def table_rows(app, table_id: str) -> list[list[str]]:
    table = app.query_one(f"#{table_id}")
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def text_of(app, widget_id: str) -> str:
    return str(app.query_one(f"#{widget_id}").render())
