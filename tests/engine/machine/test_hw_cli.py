"""`ddtree-console hw`: rendering on the synthetic fixture, --json round trip, --tp, bad input."""

from __future__ import annotations

import json

import pytest

from ddtree.console.commands import hw as hw_cmd
from ddtree.engine.machine.host import DiskInfo, host_info, numa_nodes
from ddtree.engine.machine.hw import Nvml
from ddtree.engine.machine.placement import suggest

from ...support.cli import run_hw
from .fake_nvml import FakeNvml, load_fixture, write_sysfs


@pytest.fixture
def report(tmp_path):
    fx = load_fixture()
    sys_root = write_sysfs(fx, tmp_path / "sys")
    view = Nvml(FakeNvml(fx), sys_root=sys_root).view()
    host = host_info(data_dir=tmp_path, sys_root=sys_root)
    data = view.to_dict()
    data["host"] = host.to_dict()
    path = tmp_path / "box.json"
    path.write_text(json.dumps(data))
    return view, host, path


def test_render_tables(report):
    view, host, _ = report
    text = hw_cmd.render(view, host)
    assert "GPUs: 8  driver 570.124.06  CUDA 12.8" in text
    lines = text.splitlines()
    gpu5 = next(line for line in lines if line.startswith("5 "))
    assert "NVIDIA H100 PCIe" in gpu5 and "x8/16 DEGRADED" in gpu5
    gpu2 = next(line for line in lines if line.startswith("2 "))
    assert "62.0/79.6 GiB" in gpu2 and "97%" in gpu2 and "(4242)" in gpu2
    gpu3 = next(line for line in lines if line.startswith("3 "))
    assert "n/a/350 W" in gpu3
    assert "GPU3 power_w: not supported on this GPU" in text
    row6 = next(line for line in lines if line.startswith("GPU6 "))
    assert row6.split()[1:9] == ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X", "NV12"]
    assert row6.split()[-2:] == ["24-47,72-95", "1"]
    assert "NV#   bonded set of # NVLinks" in text and "PHB" not in text.split("Legend:")[1].split("Host")[0]
    assert "NUMA nodes" in text and "Disks" in text and "data" in text


def test_json_round_trip_and_placement(report):
    view, host, path = report
    rc, out = run_hw(["--from", str(path), "--json", "--tp", "2"])
    assert rc == 0
    data = json.loads(out)
    assert len(data["gpus"]) == 8 and data["links"][6][7] == "NV12"
    assert data["placement"]["suggestions"][0]["gpus"] == [6, 7]
    assert data["placement"]["suggestions"][0]["numactl"] == ["numactl", "--cpunodebind=1", "--membind=1"]
    assert data == json.loads(run_hw(["--from", str(path), "--json", "--tp", "2"])[1])
    expected = suggest(view.gpus, view.links, 2, numa=numa_nodes(path.parent / "sys"), limit=3)
    assert [s["gpus"] for s in data["placement"]["suggestions"]] == [list(p.gpus) for p in expected]


def test_text_placement(report):
    _, _, path = report
    rc, out = run_hw(["--from", str(path), "--tp", "4"])
    assert rc == 0
    assert "Placement for TP 4" in out and "1. GPUs 4,5,6,7  worst link NODE  NUMA 1" in out
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=4,5,6,7 numactl --cpunodebind=1 --membind=1" in out


def test_real_machine_without_gpu(tmp_path):
    rc, out = run_hw([], db=str(tmp_path / "x.db"))
    assert rc == 0 and "GPUs: none (" in out and "Disks" in out
    rc, out = run_hw(["--json"])
    data = json.loads(out)
    assert data["gpus"] == [] and data["reason"] and data["host"]["cpus_logical"] >= 1


@pytest.mark.parametrize("tp, words", [("0", "must be a positive integer"), ("9", "size 9 needs 9 GPUs")])
def test_bad_tp_is_one_line_exit_2(report, tp, words):
    _, _, path = report
    rc, out = run_hw(["--from", str(path), "--tp", tp])
    assert rc == 2 and out.startswith("error: ") and words in out and "\n" not in out


def test_bad_from_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_hw(["--from", str(bad)]) == (2, f"error: {bad} is not JSON (write it with `ddtree-console hw --json`)")
    assert run_hw(["--from", str(tmp_path / "missing.json")])[0] == 2
    bad.write_text("[1, 2]")
    assert run_hw(["--from", str(bad)])[0] == 2


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(gpus=[{"index": 0}]), "the link matrix is not 1 x 1 for 1 GPU"),
    (lambda d: d.update(links=d["links"][:-1]), "the link matrix is not 8 x 8 for 8 GPUs"),
    (lambda d: d["links"][0].__setitem__(1, 5), "the link matrix holds something other than link names"),
    (lambda d: d.clear(), "no 'gpus' and 'links' lists"),
    (lambda d: d["gpus"][2].update(memory_used="62 GiB"), "memory_used is '62 GiB'"),
    (lambda d: d["host"]["disks"][0].update(free=None), "free is None"),
    (lambda d: d["host"].update(load_avg=[1.0]), "load_avg is [1.0]"),
])
def test_malformed_report_is_one_line_exit_2(report, edit, words):
    """A report `hw --json` did not write (edited by hand, cut short) is refused before any table."""
    _, _, path = report
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    assert run_hw(["--from", str(path)]) == (2, f"error: {path} is not a hw report ({words})")


def test_empty_from_path_is_refused_not_the_live_machine():
    rc, out = run_hw(["--from", ""])
    assert rc == 2 and out.startswith("error: --from needs a file name")


def test_disk_used_is_df_use_percent(report):
    """df's Use% is used / (used + available): ext4's root reserve (here 5 of 100) is not space a user
    can fill, so 50 used reads 53%, not 50% of the size; the overview's disk lines say the same."""
    view, host, _ = report
    host.disks = [DiskInfo(role="data", path="/d", mount="/", fstype="ext4", total=100 * 10**9, used=50 * 10**9,
                           free=45 * 10**9)]
    row = hw_cmd.render(view, host).splitlines()[-1]
    assert row.split() == ["data", "/d", "/", "ext4", "45.0", "100.0", "53%"]


def test_tp_on_a_machine_without_gpu_is_a_note(tmp_path):
    """--help says --tp adds suggestions: with no GPU the view still prints and says there is none to place on."""
    path = tmp_path / "nogpu.json"
    path.write_text(json.dumps({"gpus": [], "links": [], "reason": "no NVIDIA driver"}))
    rc, out = run_hw(["--from", str(path), "--tp", "2"])
    assert rc == 0 and out.splitlines() == ["GPUs: none (no NVIDIA driver)", "", "Placement for TP 2: no GPU to place on"]
    rc, out = run_hw(["--from", str(path), "--tp", "2", "--json"])
    assert rc == 0 and json.loads(out)["placement"] == {"tp": 2, "suggestions": [], "note": "no GPU to place on"}
    rc, out = run_hw(["--from", str(path), "--tp", "0"])
    assert rc == 2 and "must be a positive integer" in out
