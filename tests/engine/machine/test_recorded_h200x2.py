"""The hardware view against a real machine's recording: 2x H200 on an HGX board (NVSwitch).

Recorded on a lent machine with `ddtree-console hw --json` beside `nvidia-smi topo -m`
(fixtures/h200x2_recorded.json, fixtures/h200x2_topo.txt), so formatting, the link matrix and
placement stay checked on machines without GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree.engine.machine.hw import GpuView, nvlink_counts
from ddtree.engine.machine.placement import suggest

from .test_hw_cli import run_hw

FIXTURES = Path(__file__).parent / "fixtures"


def recorded() -> dict:
    return json.loads((FIXTURES / "h200x2_recorded.json").read_text())


def nvidia_smi_matrix() -> list[list[str]]:
    rows = [line.split("\t") for line in (FIXTURES / "h200x2_topo.txt").read_text().splitlines()[1:] if line]
    return [[cell.strip() for cell in row[1:3]] for row in rows if row[0].startswith("GPU")]


def test_switch_links_count_like_nvidia_smi():
    view = GpuView.from_dict(recorded())
    counts = nvlink_counts(view.gpus)
    ours = [["X" if i == j else f"NV{counts[i][j]}" for j in range(2)] for i in range(2)]
    assert ours == nvidia_smi_matrix() == [["X", "NV18"], ["NV18", "X"]]


def test_p2p_veto_drops_a_switch_pair():
    view = GpuView.from_dict(recorded())
    assert nvlink_counts(view.gpus, lambda i, j: False)[0][1] == 0
    assert nvlink_counts(view.gpus, lambda i, j: None)[0][1] == 18  # query unsupported: keep


def test_placement_tp2_takes_both_gpus_over_nvlink():
    view = GpuView.from_dict(recorded())
    best = suggest(view.gpus, view.links, 2)[0]
    assert list(best.gpus) == [0, 1]
    assert best.worst_link == "NV18"


def test_cli_renders_the_recording(tmp_path):
    path = tmp_path / "h200x2.json"
    path.write_text(json.dumps(recorded()))
    rc, text = run_hw(["--from", str(path), "--tp", "2"])
    assert rc == 0
    assert "NVIDIA H200" in text and "NV18" in text
    rc, text = run_hw(["--from", str(path), "--tp", "4"])
    assert rc == 2 and text.startswith("error:")
