"""Hardware view: the real no-GPU path, and NVML collection/topology/placement on a synthetic fixture."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pynvml
import pytest

from ddtree.engine.machine.host import disk_info, existing_parent, host_info, numa_nodes
from ddtree.engine.machine.hw import GpuView, Nvml, format_cpulist, link_rank, parse_cpulist
from ddtree.engine.machine.placement import PlacementError, suggest
from ddtree.engine.machine.sampler import Sampler, SamplerConfig, SamplerConfigError

from .fake_nvml import FakeNvml, load_fixture, write_sysfs


@pytest.fixture
def box(tmp_path):
    fx = load_fixture()
    sys_root = write_sysfs(fx, tmp_path / "sys")
    session = Nvml(FakeNvml(fx), sys_root=sys_root)
    return fx, session, sys_root


def _has_real_gpu() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


# -- the real path on this machine -------------------------------------------------------------
@pytest.mark.skipif(_has_real_gpu(), reason="this machine has an NVIDIA driver")
def test_no_driver_gives_empty_list_with_reason():
    view = Nvml().view()
    assert view.gpus == [] and view.links == []
    assert "NVML" in view.reason or "driver" in view.reason


def test_init_errors_map_to_reasons(box):
    fx, _, _ = box
    for code, words in [(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver"),
                        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver not loaded")]:
        fake = FakeNvml(fx, init_error=code)
        session = Nvml(fake)
        view = session.view()
        assert view.gpus == [] and words in view.reason
        session.view()
        assert fake.calls.count("nvmlInit") == 1  # initialised once, even after a failure


def test_no_gpu_reason(box):
    fx, _, _ = box
    view = Nvml(FakeNvml(dict(fx, gpus=[]))).view()
    assert view.gpus == [] and view.reason == "NVML found no GPU"


# -- collection against the fixture ------------------------------------------------------------
def test_collects_every_field(box):
    fx, session, _ = box
    view = session.view()
    assert view.reason is None and len(view.gpus) == 8
    assert view.driver_version == "570.124.06" and view.cuda_driver_version == "12.8"
    g0 = view.gpus[0]
    assert g0.name == "NVIDIA H100 PCIe" and g0.bus_id == "00000000:18:00.0"
    assert g0.memory_total == 85520809984 and g0.power_cap_w == 350.0 and g0.power_w == 48.0
    assert g0.numa_node == 0 and g0.cpu_affinity == parse_cpulist("0-23,48-71")
    assert g0.pcie_gen == 1 and g0.pcie_gen_max == 5 and g0.pcie_degraded is False
    assert g0.unavailable == {}
    assert view.gpus[5].pcie_degraded is True
    busy = view.gpus[2]
    assert busy.util_gpu == 97.0 and [p.pid for p in busy.processes] == [4242]
    assert busy.processes[0].used_memory == 61 * 1024**3


def test_unsupported_query_is_none_with_reason_and_sysfs_fallback(box):
    _, session, _ = box
    g3 = session.view().gpus[3]
    assert g3.power_w is None and g3.unavailable["power_w"] == "not supported on this GPU"
    # NVML lacks the NUMA query for this GPU; /sys/bus/pci/devices/<bus>/numa_node fills it in
    assert g3.numa_node == 0 and "numa_node" not in g3.unavailable


def test_topology_matrix(box):
    _, session, _ = box
    links = session.view().links
    assert [links[i][i] for i in range(8)] == ["X"] * 8
    assert links[0][1] == "PIX" and links[0][2] == "PXB" and links[4][6] == "NODE"
    assert links[0][4] == links[7][3] == "SYS"
    assert links[6][7] == links[7][6] == "NV12"
    assert all(links[i][j] == links[j][i] for i in range(8) for j in range(8))


def test_static_values_cached_dynamic_requeried(box):
    fx, session, _ = box
    fake = session._lib
    session.view()
    first_names = fake.calls.count("nvmlDeviceGetName")
    topo = fake.calls.count("nvmlDeviceGetTopologyCommonAncestor")
    fx["gpus"][0]["util_gpu"] = 55
    view = session.view()
    assert fake.calls.count("nvmlDeviceGetName") == first_names == 8
    assert fake.calls.count("nvmlDeviceGetTopologyCommonAncestor") == topo
    assert view.gpus[0].util_gpu == 55.0


def test_view_round_trips_through_json(box):
    _, session, _ = box
    view = session.view()
    again = GpuView.from_dict(json.loads(json.dumps(view.to_dict())))
    assert again.to_dict() == view.to_dict()


def test_link_rank_and_cpulists():
    assert sorted(["SYS", "PIX", "NV4", "NODE", "NV12", "PXB", "PHB"], key=link_rank) == [
        "NV12", "NV4", "PIX", "PXB", "PHB", "NODE", "SYS"]
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


# -- host --------------------------------------------------------------------------------------
def test_numa_nodes_from_sysfs(box):
    _, _, sys_root = box
    nodes = numa_nodes(sys_root)
    assert [n.node for n in nodes] == [0, 1]
    assert nodes[1].cpus == parse_cpulist("24-47,72-95")
    assert nodes[0].memory_total == 527939812 * 1024 and nodes[0].distances == [10, 21]


def test_host_info_real(tmp_path):
    info = host_info(data_dir=tmp_path / "not" / "yet")
    assert info.cpus_logical >= 1 and info.memory_total > 0 and info.numa
    roles = {d.role: d for d in info.disks}
    assert set(roles) == {"hf_cache", "data"}
    assert roles["data"].free > 0 and roles["data"].total >= roles["data"].free
    assert existing_parent(tmp_path / "not" / "yet") == tmp_path
    assert disk_info(tmp_path).mount is not None


# -- placement ---------------------------------------------------------------------------------
def test_placement_tp2_prefers_nvlink_then_free_pix_pairs(box):
    _, session, sys_root = box
    view = session.view()
    nodes = numa_nodes(sys_root)
    best = suggest(view.gpus, view.links, 2, numa=nodes, limit=4)
    assert [p.gpus for p in best] == [(6, 7), (0, 1), (4, 5), (0, 3)]
    assert best[0].worst_link == "NV12" and best[1].worst_link == "PIX"
    assert best[0].numactl == ("numactl", "--cpunodebind=1", "--membind=1")
    assert best[0].cpulist == "24-47,72-95"
    assert best[0].env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "6,7"}
    assert any("degraded" in n for n in best[2].notes)


def test_placement_tp4_stays_on_one_numa_node(box):
    _, session, sys_root = box
    view = session.view()
    best = suggest(view.gpus, view.links, 4, numa=numa_nodes(sys_root))
    # GPU 2 is busy, so socket 0 has no free set of four: socket 1 wins although its worst link is NODE
    assert best[0].gpus == (4, 5, 6, 7) and best[0].numa_nodes == (1,) and best[0].worst_link == "NODE"
    # a free set across sockets still beats a set holding the busy GPU
    assert 2 not in best[1].gpus and best[1].numa_nodes == (0, 1) and best[1].worst_link == "SYS"
    assert all(2 not in p.gpus for p in best)
    # with GPU 2 free, the PXB set on socket 0 beats the NODE set
    view.gpus[2].processes = []
    view.gpus[2].memory_used = 0
    assert suggest(view.gpus, view.links, 4)[0].gpus == (0, 1, 2, 3)


def test_placement_tp8_spans_both_nodes(box):
    _, session, sys_root = box
    view = session.view()
    (only,) = suggest(view.gpus, view.links, 8, numa=numa_nodes(sys_root))
    assert only.gpus == tuple(range(8)) and only.worst_link == "SYS" and only.numa_nodes == (0, 1)
    assert only.numactl == () and any("every NUMA node" in n for n in only.notes)


def test_placement_bad_input(box):
    _, session, _ = box
    view = session.view()
    for tp in (0, 9, -1, "2"):
        with pytest.raises(PlacementError) as err:
            suggest(view.gpus, view.links, tp)
        assert err.value.exit_code == 2
    with pytest.raises(PlacementError):
        suggest([], [], 1)


# -- sampler -----------------------------------------------------------------------------------
def test_sampler_reads_gpus_and_host(box):
    _, session, _ = box
    sampler = Sampler(SamplerConfig(rate_hz=50), session=session)
    s = sampler.sample()
    assert len(s.gpus) == 8 and s.gpus[2].util == 97.0 and s.gpus[3].power_w is None
    assert s.mem_total > 0 and s.cost_s >= 0


def test_sampler_rate_and_stop(box):
    _, session, _ = box
    sampler = Sampler(SamplerConfig(rate_hz=20, max_duty=1.0), session=session)
    stop = threading.Event()
    got = []
    t0 = time.monotonic()
    thread = sampler.start(stop, on_sample=lambda s: got.append(s) or (len(got) >= 6 and stop.set()))
    thread.join(5)
    elapsed = time.monotonic() - t0
    assert not thread.is_alive() and len(got) == 6
    assert elapsed >= 5 / 20 * 0.8  # six samples at 20 Hz span five intervals


def test_sampler_stretches_interval_when_ticks_are_costly(box):
    _, session, _ = box
    sampler = Sampler(SamplerConfig(rate_hz=10, max_duty=0.01), session=session)
    sampler._account(0.005)  # a 5 ms tick may run at most every 0.5 s to stay under 1%
    assert sampler.interval_s == pytest.approx(0.5)


def test_sampler_hands_samples_to_the_store_writer_with_retention(box, tmp_path):
    from sqlite_utils import Database

    from ddtree.store.telemetry import TelemetryWriter

    _, session, _ = box
    db = Database(tmp_path / "t.db")
    db["telemetry"].create({"id": int, "at": float, "gpu_index": int, "util": float, "mem_used": int,
                            "mem_total": int, "power_w": float, "temp_c": float, "job_id": int}, pk="id")
    db["telemetry"].insert({"at": time.time() - 3600, "gpu_index": 0, "util": 1.0})
    writer = TelemetryWriter(db, labels={"job_id": 7}, retention_s=10)
    sampler = Sampler(SamplerConfig(rate_hz=20, max_duty=1.0), session=session)
    stop = threading.Event()
    written = []
    sampler.run(stop, sink=lambda s: written.append(writer(s)), on_sample=lambda s: stop.set())
    assert written == [8]
    rows = list(db["telemetry"].rows)
    assert len(rows) == 8 and {r["job_id"] for r in rows} == {7}
    assert rows[2]["util"] == 97.0 and rows[3]["power_w"] is None and rows[0]["temp_c"] == 34.0


def test_sampler_config_validation():
    for kwargs in ({"rate_hz": 0}, {"rate_hz": 1000}, {"max_duty": 0}):
        with pytest.raises(SamplerConfigError):
            SamplerConfig(**kwargs)


def test_engine_modules_do_not_import_torch_or_textual():
    code = ("import sys, ddtree.engine.machine.hw, ddtree.engine.machine.host, ddtree.engine.machine.placement, ddtree.engine.machine.sampler;"
            "bad = [m for m in ('torch', 'textual', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_empty_view_says_whether_the_machine_surely_has_no_gpu(box):
    """No driver or none counted: surely none (the engine form refuses cuda). A reading NVML could
    not finish (here GPU 3 cannot be opened) leaves the list empty too, but says nothing of the GPUs."""
    fx, _, _ = box
    for code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
        assert Nvml(FakeNvml(fx, init_error=code)).view().none_here
    assert Nvml(FakeNvml(dict(fx, gpus=[]))).view().none_here
    for reason in ("insufficient permissions", "GPU 3: GPU is lost", "cannot count GPUs: Unknown Error"):
        assert not GpuView(reason=reason).none_here
    assert not Nvml(FakeNvml(fx)).view().none_here  # GPUs read
