"""A stand-in for pynvml driven by a JSON fixture, for tests on machines without a GPU.

It raises the real `pynvml.NVMLError` subclasses, so the code under test sees what a real driver
would raise for an unsupported query. `write_sysfs(fixture, root)` lays out the /sys files the host
and NUMA code read.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pynvml

from ddtree.engine.machine.hw import parse_cpulist

FIXTURES = Path(__file__).parent / "fixtures"
_LEVELS = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


def load_fixture(name: str = "pcie8_2numa.json") -> dict:
    return json.loads((FIXTURES / name).read_text())


def _not_supported():
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


class FakeNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, fixture: dict, *, init_error: int | None = None) -> None:
        self.fx = fixture
        self.init_error = init_error
        self.calls: list[str] = []

    def _gpu(self, handle: int, fn: str) -> dict:
        self.calls.append(fn)
        g = self.fx["gpus"][handle]
        if fn in g.get("unsupported", []):
            raise _not_supported()
        return g

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        return len(self.fx["gpus"])

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlSystemGetDriverVersion(self):
        return self.fx["driver_version"]

    def nvmlSystemGetCudaDriverVersion(self):
        return self.fx["cuda_driver_version"]

    def nvmlDeviceGetName(self, h):
        return self._gpu(h, "nvmlDeviceGetName")["name"]

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h, "nvmlDeviceGetUUID")["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._gpu(h, "nvmlDeviceGetPciInfo")["bus_id"])

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=g["memory_total"], used=g["memory_used"],
                               free=g["memory_total"] - g["memory_used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g["util_gpu"], memory=g["util_memory"])

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._gpu(h, "nvmlDeviceGetTemperature")["temperature_c"]

    def nvmlDeviceGetPowerUsage(self, h):
        return self._gpu(h, "nvmlDeviceGetPowerUsage")["power_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit")["power_cap_mw"]

    def nvmlDeviceGetClockInfo(self, h, kind):
        g = self._gpu(h, "nvmlDeviceGetClockInfo")
        return g["clock_sm_mhz"] if kind == pynvml.NVML_CLOCK_SM else g["clock_mem_mhz"]

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        g = self._gpu(h, "nvmlDeviceGetMaxClockInfo")
        return g["clock_sm_max_mhz"] if kind == pynvml.NVML_CLOCK_SM else g["clock_mem_max_mhz"]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._gpu(h, "nvmlDeviceGetCurrPcieLinkGeneration")["pcie_gen"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._gpu(h, "nvmlDeviceGetMaxPcieLinkGeneration")["pcie_gen_max"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._gpu(h, "nvmlDeviceGetCurrPcieLinkWidth")["pcie_width"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._gpu(h, "nvmlDeviceGetMaxPcieLinkWidth")["pcie_width_max"]

    def nvmlDeviceGetNumaNodeId(self, h):
        return self._gpu(h, "nvmlDeviceGetNumaNodeId")["numa_node"]

    def nvmlDeviceGetCpuAffinity(self, h, words):
        cpus = parse_cpulist(self._gpu(h, "nvmlDeviceGetCpuAffinity")["cpu_affinity"])
        mask = [0] * words
        for c in cpus:
            if c // 64 < words:
                mask[c // 64] |= 1 << (c % 64)
        return mask

    def _links(self, h, fn):
        links = self._gpu(h, fn)["nvlinks"]
        if links is None:
            raise _not_supported()
        return links

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = self._links(h, "nvmlDeviceGetNvLinkState")
        if link >= len(links):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if links[link]["active"] else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self._links(h, "nvmlDeviceGetNvLinkRemotePciInfo")[link]["remote_bus_id"])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        self.calls.append("nvmlDeviceGetTopologyCommonAncestor")
        return _LEVELS[self.fx["topology"][a][b]]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        procs = self._gpu(h, "nvmlDeviceGetComputeRunningProcesses")["processes"]
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_memory"]) for p in procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        self._gpu(h, "nvmlDeviceGetGraphicsRunningProcesses")
        return []


def write_sysfs(fixture: dict, root: Path) -> Path:
    """Write the NUMA node and PCI device files of `fixture` under `root` (a fake /sys)."""
    for n in fixture["numa"]:
        d = root / "devices/system/node" / f"node{n['node']}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(n["cpus"] + "\n")
        (d / "distance").write_text(n["distance"] + "\n")
        (d / "meminfo").write_text(
            f"Node {n['node']} MemTotal:       {n['mem_total_kb']} kB\n"
            f"Node {n['node']} MemFree:        {n['mem_free_kb']} kB\n"
        )
    for g in fixture["gpus"]:
        domain, _, rest = g["bus_id"].partition(":")
        d = root / "bus/pci/devices" / f"{domain[-4:]}:{rest}".lower()
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{g['numa_node']}\n")
        (d / "local_cpulist").write_text(g["cpu_affinity"] + "\n")
    return root
