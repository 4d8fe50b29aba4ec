"""The host around the GPUs: NUMA nodes, CPU, memory, and the disks that hold models and data.

NUMA facts come from /sys (the root is a parameter so tests can point at a recorded tree);
CPU and memory use from psutil; free space from statvfs on the nearest existing folder.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ddtree.engine.machine.hw import parse_cpulist, report_fields


@dataclass
class NumaNode:
    node: int
    cpus: list[int] = field(default_factory=list)
    memory_total: int | None = None  # bytes
    memory_free: int | None = None
    distances: list[int] = field(default_factory=list)


@dataclass
class DiskInfo:
    """The filesystem that holds `path` (which may not exist yet: its nearest existing parent)."""

    role: str  # "hf_cache", "data", ...
    path: str
    mount: str | None
    fstype: str | None
    total: int
    used: int
    free: int


@dataclass
class HostInfo:
    hostname: str
    cpu_model: str | None
    cpus_logical: int
    cpus_physical: int | None
    cpu_percent: float | None
    load_avg: tuple[float, float, float] | None
    memory_total: int
    memory_available: int
    memory_percent: float
    numa: list[NumaNode] = field(default_factory=list)
    disks: list[DiskInfo] = field(default_factory=list)
    affinity: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HostInfo:
        data = dict(data)
        data["numa"] = [NumaNode(**report_fields(NumaNode, n)) for n in data.get("numa") or []]
        data["disks"] = [DiskInfo(**report_fields(DiskInfo, d)) for d in data.get("disks") or []]
        data = report_fields(cls, data)
        if data.get("load_avg") is not None:
            if len(data["load_avg"]) != 3:
                raise ValueError(f"load_avg is {data['load_avg']!r:.40}")
            data["load_avg"] = tuple(data["load_avg"])
        return cls(**data)


def _meminfo_kb(text: str, key: str) -> int | None:
    for line in text.splitlines():
        # per-node files read "Node 0 MemTotal:   5335256 kB"
        parts = line.replace(":", " ").split()
        if key in parts:
            i = parts.index(key)
            try:
                return int(parts[i + 1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def numa_nodes(sys_root: str | os.PathLike = "/sys") -> list[NumaNode]:
    """NUMA nodes with their CPUs and memory; one node holding every CPU when /sys has none."""
    base = Path(sys_root) / "devices/system/node"
    nodes = []
    for entry in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        node = NumaNode(node=int(entry.name[4:]))
        try:
            node.cpus = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            pass
        try:
            text = (entry / "meminfo").read_text()
            node.memory_total = _meminfo_kb(text, "MemTotal")
            node.memory_free = _meminfo_kb(text, "MemFree")
        except OSError:
            pass
        try:
            node.distances = [int(x) for x in (entry / "distance").read_text().split()]
        except (OSError, ValueError):
            pass
        nodes.append(node)
    if not nodes:
        vm = psutil.virtual_memory()
        nodes.append(NumaNode(node=0, cpus=list(range(os.cpu_count() or 1)), memory_total=vm.total,
                              memory_free=vm.available, distances=[10]))
    return nodes


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def existing_parent(path: str | os.PathLike) -> Path:
    """The nearest folder that exists at or above `path` (a download target may not exist yet)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_info(path: str | os.PathLike, role: str = "") -> DiskInfo:
    target = existing_parent(path)
    usage = shutil.disk_usage(target)
    mount, fstype = None, None
    best = -1
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (str(target) == mp or str(target).startswith(mp.rstrip("/") + "/")) and len(mp) > best:
            best, mount, fstype = len(mp), mp, part.fstype
    return DiskInfo(role=role, path=str(Path(path).expanduser()), mount=mount, fstype=fstype,
                    total=usage.total, used=usage.used, free=usage.free)


def hf_cache_dir() -> str:
    # imported here: huggingface_hub reads its environment at import, and callers may set HF_HOME first
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def host_info(*, data_dir: str | os.PathLike | None = None, extra_paths: dict[str, str] | None = None,
              sys_root: str | os.PathLike = "/sys", cpu_interval: float | None = None) -> HostInfo:
    """A snapshot of the host; `data_dir` and `extra_paths` name folders whose disks to report.

    `cpu_interval` seconds of CPU measurement; None reads the use since the previous call (the
    first call in a process then reads 0).
    """
    vm = psutil.virtual_memory()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    paths = {"hf_cache": hf_cache_dir()}
    if data_dir is not None:
        paths["data"] = str(data_dir)
    paths.update(extra_paths or {})
    disks = [disk_info(p, role) for role, p in paths.items()]
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = list(range(os.cpu_count() or 1))
    return HostInfo(
        hostname=platform.node(),
        cpu_model=_cpu_model(),
        cpus_logical=psutil.cpu_count(logical=True) or 1,
        cpus_physical=psutil.cpu_count(logical=False),
        cpu_percent=psutil.cpu_percent(interval=cpu_interval),
        load_avg=tuple(load) if load else None,
        memory_total=vm.total,
        memory_available=vm.available,
        memory_percent=vm.percent,
        numa=numa_nodes(sys_root),
        disks=disks,
        affinity=affinity,
    )
