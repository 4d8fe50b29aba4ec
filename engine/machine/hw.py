"""GPU discovery through NVML (nvidia-ml-py, imported as pynvml).

Every NVML call goes through `Nvml.query`, which turns an NVML error into `(None, reason)`, so an
unsupported query shows as "unavailable" with its reason instead of crashing. No driver or no GPU
gives an empty GPU list plus the reason. NVML is initialised once per process (`nvml()`), and the
values that do not change while a process runs (names, bus ids, limits, topology) are cached.

The NVML library is injectable: anything with pynvml's function names and `NVMLError` works, which
is how the tests drive this module from a fixture on a machine without a GPU.
"""

from __future__ import annotations

import math
import os
import threading
import time
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ddtree.engine.units import plural

# NVML's common-ancestor levels, named as `nvidia-smi topo -m` names them.
TOPOLOGY_NAMES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# Lower is better; NVLink beats every PCIe path.
LINK_RANK = {"NV": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}
LINK_MEANING = {
    "NV#": "bonded set of # NVLinks",
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges, no host bridge",
    "PHB": "through a PCIe host bridge (the CPU)",
    "NODE": "across host bridges within one NUMA node",
    "SYS": "across NUMA nodes (SMP interconnect, e.g. QPI/UPI)",
}
_NVML_MAX_LINKS = 18  # probing stops at the first link index NVML rejects
_CLOCK_SM, _CLOCK_MEM, _TEMPERATURE_GPU = 1, 2, 0
_P2P_CAPS_INDEX_NVLINK, _P2P_STATUS_OK = 2, 0  # pynvml NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK
# NVML's clocks event (formerly "throttle") reason bits, named as nvidia-smi -q names them.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def clock_event_names(mask: int) -> tuple[str, ...]:
    """The named reasons set in an NVML clocks event bitmask (unknown bits as 'bit_0x...')."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENT_REASONS)
    if rest:
        names.append(f"bit_{rest:#x}")
    return tuple(names)


@dataclass(frozen=True)
class NvLink:
    link: int
    active: bool
    remote_bus_id: str | None = None


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str | None = None
    used_memory: int | None = None  # bytes


@dataclass
class GpuInfo:
    """One GPU. A field is None when NVML could not tell; `unavailable[field]` says why."""

    index: int
    name: str | None = None
    uuid: str | None = None
    bus_id: str | None = None
    numa_node: int | None = None
    cpu_affinity: list[int] = field(default_factory=list)
    memory_total: int | None = None  # bytes
    memory_used: int | None = None
    util_gpu: float | None = None  # percent
    util_memory: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_cap_w: float | None = None
    clock_sm_mhz: int | None = None
    clock_mem_mhz: int | None = None
    clock_sm_max_mhz: int | None = None
    clock_mem_max_mhz: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlinks: list[NvLink] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def pcie_degraded(self) -> bool | None:
        """True when the link trained narrower than the slot allows.

        A lower generation alone is not flagged: idle GPUs drop their PCIe generation to save power.
        """
        if self.pcie_width is None or self.pcie_width_max is None:
            return None
        return self.pcie_width < self.pcie_width_max

    @classmethod
    def from_dict(cls, data: dict) -> GpuInfo:
        data = dict(data)
        data["nvlinks"] = [NvLink(**report_fields(NvLink, x)) for x in data.get("nvlinks") or []]
        data["processes"] = [GpuProcess(**report_fields(GpuProcess, x)) for x in data.get("processes") or []]
        return cls(**report_fields(cls, data))


def report_fields(cls: type, data: dict) -> dict:
    """The fields of dataclass `cls` found in `data` (a report read back from JSON), others dropped.

    ValueError names the first whose value is not of its annotated type: the tables do arithmetic
    on these values, so a report edited by hand must fail here with a line, not there with a traceback.
    """
    if not isinstance(data, dict):
        raise ValueError(f"expected an object for {cls.__name__}, got {data!r:.40}")
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        if key in hints:
            if not _is_a(value, hints[key]):
                raise ValueError(f"{key} is {value!r:.40}")
            out[key] = value
    return out


def _is_a(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_is_a(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        # an int is a fine float (JSON writes 80.0 as 80 from some writers); a bool is no number here
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_is_a(x, args[0]) for x in value)
    if origin is dict:
        return isinstance(value, dict) and all(_is_a(k, args[0]) and _is_a(v, args[1]) for k, v in value.items())
    return isinstance(value, hint)


@dataclass
class GpuView:
    """What NVML says about the machine's GPUs. `reason` is set when the list is empty for a cause."""

    gpus: list[GpuInfo] = field(default_factory=list)
    links: list[list[str]] = field(default_factory=list)  # like `nvidia-smi topo -m`
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    reason: str | None = None
    at: float = 0.0

    @property
    def none_here(self) -> bool:
        """Whether the machine surely has no NVIDIA GPU (CUDA sees none either): the list is empty
        for no driver or none counted, not because NVML could not finish reading (then: unknown)."""
        return not self.gpus and (self.reason or NO_GPU).startswith(_NONE_HERE)

    def to_dict(self) -> dict:
        out = asdict(self)
        for gpu, raw in zip(self.gpus, out["gpus"]):
            raw["pcie_degraded"] = gpu.pcie_degraded
        return out

    @classmethod
    def from_dict(cls, data: dict) -> GpuView:
        """The inverse of `to_dict`; ValueError (or TypeError) for data it did not write.

        `view()` always writes both lists, the link matrix n x n for n GPUs (empty with no GPU),
        so a missing or ragged one means the data is not a report, not an optional part left out."""
        gpus, links = data.get("gpus"), data.get("links")
        if not isinstance(gpus, list) or not isinstance(links, list):
            raise ValueError("no 'gpus' and 'links' lists")
        n = len(gpus)
        if len(links) != n or any(not isinstance(row, list) or len(row) != n for row in links):
            raise ValueError(f"the link matrix is not {n} x {n} for {plural(n, 'GPU')}")
        if not all(isinstance(level, str) for row in links for level in row):
            raise ValueError("the link matrix holds something other than link names")
        return cls(
            gpus=[GpuInfo.from_dict(g) for g in gpus],
            links=[list(row) for row in links],
            driver_version=data.get("driver_version"),
            cuda_driver_version=data.get("cuda_driver_version"),
            reason=data.get("reason"),
            at=float(data.get("at") or 0.0),
        )


def nvlink_counts(gpus: list[GpuInfo], p2p: Any = None) -> list[list[int]]:
    """Active NVLinks between each pair of GPUs (symmetric, 0 where none).

    A link whose far end is another GPU counts for that pair. A link whose far end is not a GPU
    (an NVSwitch: NVML reports its bus id as FFFFFFFF:FF:FF.0 on HGX boards) joins every GPU with
    such links, as `nvidia-smi topo -m` shows them (NV18 between any two H200s of one HGX board);
    `p2p(i, j)`, when given and answering, vetoes pairs whose NVLink peer access is not OK.
    """
    n = len(gpus)
    by_bus = {(g.bus_id or "").upper(): k for k, g in enumerate(gpus)}
    direct = [[0] * n for _ in range(n)]
    switched = [0] * n
    for k, g in enumerate(gpus):
        for link in g.nvlinks:
            if not link.active:
                continue
            peer = by_bus.get((link.remote_bus_id or "").upper())
            if peer is None:
                switched[k] += 1
            elif peer != k:
                direct[k][peer] += 1
    counts = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            count = max(direct[i][j], direct[j][i])
            if not count and switched[i] and switched[j]:
                ok = p2p(i, j) if p2p is not None else None
                count = min(switched[i], switched[j]) if ok is not False else 0
            counts[i][j] = counts[j][i] = count
    return counts


def link_rank(level: str) -> tuple[int, int]:
    """Sort key for a topology entry: NVLink first (more links better), then PCIe levels."""
    if level.startswith("NV"):
        count = int(level[2:]) if level[2:].isdigit() else 1
        return (LINK_RANK["NV"], -count)
    return (LINK_RANK.get(level, 9), 0)


#: The reasons for an empty GPU list that say the machine has no NVIDIA GPU for CUDA either: no
#: driver, a driver not loaded, or one that counts none (GpuView.none_here). Any other (permissions,
#: a GPU NVML cannot open, no nvidia-ml-py) says only that NVML could not tell.
NO_DRIVER = "NVML library not found (no NVIDIA driver installed)"
DRIVER_NOT_LOADED = "NVIDIA driver not loaded"
NO_GPU = "NVML found no GPU"
_NONE_HERE = ("NVML library not found", DRIVER_NOT_LOADED, NO_GPU)


def _error_reason(error: Exception) -> str:
    text = str(error)
    code = getattr(error, "value", None)
    if code == 12:  # NVML_ERROR_LIBRARY_NOT_FOUND
        return NO_DRIVER
    if code == 9:  # NVML_ERROR_DRIVER_NOT_LOADED
        return DRIVER_NOT_LOADED
    if code == 3:
        return "not supported on this GPU"
    if code == 4:
        return "insufficient permissions"
    if code == 13:
        return "function not found in this driver"
    return text or type(error).__name__


def _load_pynvml() -> tuple[Any, str | None]:
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    return pynvml, None


def _cpus_from_mask(words: Any) -> list[int]:
    cpus = []
    for w, word in enumerate(words):
        word = int(word)
        for bit in range(64):
            if word >> bit & 1:
                cpus.append(w * 64 + bit)
    return cpus


def _sysfs_bus_id(bus_id: str) -> str:
    # NVML writes an 8-digit PCI domain in upper case; sysfs uses 4 digits, lower case.
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


class Nvml:
    """A process-wide NVML session: initialised once, slow-changing values cached."""

    def __init__(self, lib: Any = None, *, sys_root: str | os.PathLike = "/sys") -> None:
        self._lib = lib
        self._sys_root = Path(sys_root)
        self._lock = threading.Lock()
        self._started = False
        self._reason: str | None = None
        self._handles: list[Any] = []
        self._static: dict[int, GpuInfo] = {}
        self._links: list[list[str]] | None = None
        self._versions: tuple[str | None, str | None] = (None, None)

    # -- the one place that calls NVML --------------------------------------------------------
    def query(self, fn: str, *args: Any) -> tuple[Any, str | None]:
        """Call NVML function `fn`; returns (value, None) or (None, reason)."""
        func = getattr(self._lib, fn, None)
        if func is None:
            return None, f"{fn} is missing from this nvidia-ml-py"
        try:
            return func(*args), None
        except self._lib.NVMLError as error:
            return None, _error_reason(error)

    def start(self) -> str | None:
        """Initialise NVML once; returns the reason it is unusable, or None."""
        with self._lock:
            if self._started:
                return self._reason
            self._started = True
            if self._lib is None:
                self._lib, self._reason = _load_pynvml()
                if self._reason:
                    return self._reason
            _, reason = self.query("nvmlInit")
            if reason:
                self._reason = reason
                return reason
            count, reason = self.query("nvmlDeviceGetCount")
            if reason:
                self._reason = f"cannot count GPUs: {reason}"
                return self._reason
            if not count:
                self._reason = NO_GPU
            for i in range(count or 0):
                handle, reason = self.query("nvmlDeviceGetHandleByIndex", i)
                if reason:
                    self._reason = f"GPU {i}: {reason}"
                    self._handles = []
                    break
                self._handles.append(handle)
            driver, _ = self.query("nvmlSystemGetDriverVersion")
            cuda, _ = self.query("nvmlSystemGetCudaDriverVersion")
            cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
            self._versions = (driver, cuda_text)
            return self._reason

    @property
    def reason(self) -> str | None:
        return self.start()

    @property
    def count(self) -> int:
        self.start()
        return len(self._handles)

    def close(self) -> None:
        with self._lock:
            if self._started and self._lib is not None and self._reason is None:
                self.query("nvmlShutdown")
            self._started = False
            self._handles = []
            self._static.clear()
            self._links = None

    # -- static (cached) ------------------------------------------------------------------------
    def _get(self, gpu: GpuInfo, name: str, fn: str, *args: Any) -> Any:
        value, reason = self.query(fn, *args)
        if reason:
            gpu.unavailable[name] = reason
        return value

    def static_info(self, index: int) -> GpuInfo:
        """Name, ids, limits, NUMA node, CPU affinity, NVLinks: read once per process."""
        cached = self._static.get(index)
        if cached is not None:
            return cached
        h = self._handles[index]
        gpu = GpuInfo(index=index)
        gpu.name = self._get(gpu, "name", "nvmlDeviceGetName", h)
        gpu.uuid = self._get(gpu, "uuid", "nvmlDeviceGetUUID", h)
        pci = self._get(gpu, "bus_id", "nvmlDeviceGetPciInfo", h)
        gpu.bus_id = getattr(pci, "busId", None) if pci is not None else None
        mem = self._get(gpu, "memory_total", "nvmlDeviceGetMemoryInfo", h)
        gpu.memory_total = int(mem.total) if mem is not None else None
        cap = self._get(gpu, "power_cap_w", "nvmlDeviceGetEnforcedPowerLimit", h)
        gpu.power_cap_w = cap / 1000.0 if cap is not None else None
        gpu.clock_sm_max_mhz = self._get(gpu, "clock_sm_max_mhz", "nvmlDeviceGetMaxClockInfo", h, _CLOCK_SM)
        gpu.clock_mem_max_mhz = self._get(gpu, "clock_mem_max_mhz", "nvmlDeviceGetMaxClockInfo", h, _CLOCK_MEM)
        gpu.pcie_gen_max = self._get(gpu, "pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", h)
        gpu.pcie_width_max = self._get(gpu, "pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", h)
        gpu.numa_node, gpu.cpu_affinity = self._numa(gpu, h)
        gpu.nvlinks = self._nvlinks(h)
        self._static[index] = gpu
        return gpu

    def _numa(self, gpu: GpuInfo, handle: Any) -> tuple[int | None, list[int]]:
        node, node_reason = self.query("nvmlDeviceGetNumaNodeId", handle)
        # room for 1024 CPUs at least: NVML fills what exists, and a short array would cut CPUs off
        words = math.ceil(max(os.cpu_count() or 1, 1024) / 64)
        mask, mask_reason = self.query("nvmlDeviceGetCpuAffinity", handle, words)
        cpus = _cpus_from_mask(mask) if mask is not None else []
        # Older drivers lack the NUMA query; the PCI device's sysfs entry has the same fact.
        if (node is None or node < 0 or not cpus) and gpu.bus_id:
            dev = self._sys_root / "bus/pci/devices" / _sysfs_bus_id(gpu.bus_id)
            if node is None or node < 0:
                try:
                    node = int((dev / "numa_node").read_text())
                    node_reason = None
                except (OSError, ValueError):
                    pass
            if not cpus:
                try:
                    cpus = parse_cpulist((dev / "local_cpulist").read_text())
                    mask_reason = None
                except (OSError, ValueError):
                    pass
        if node is not None and node < 0:
            node, node_reason = None, "the platform reports no NUMA node"
        if node is None and cpus:
            # VMs often hide the device's node (-1) while its CPUs all sit in one node; that node is
            # what `nvidia-smi topo -m` prints as the GPU's NUMA affinity.
            inferred = self._node_holding(cpus)
            if inferred is not None:
                node, node_reason = inferred, None
        if node_reason:
            gpu.unavailable["numa_node"] = node_reason
        if mask_reason:
            gpu.unavailable["cpu_affinity"] = mask_reason
        return node, cpus

    def _node_holding(self, cpus: list[int]) -> int | None:
        wanted = set(cpus)
        for entry in sorted((self._sys_root / "devices/system/node").glob("node[0-9]*")):
            try:
                if wanted <= set(parse_cpulist((entry / "cpulist").read_text())):
                    return int(entry.name[4:])
            except (OSError, ValueError):
                continue
        return None

    def _nvlinks(self, handle: Any) -> list[NvLink]:
        links = []
        for link in range(_NVML_MAX_LINKS):
            state, reason = self.query("nvmlDeviceGetNvLinkState", handle, link)
            if reason:
                break  # no NVLink at all, or past the last link of this GPU
            remote = None
            if state:
                pci, _ = self.query("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                remote = getattr(pci, "busId", None) if pci is not None else None
            links.append(NvLink(link=link, active=bool(state), remote_bus_id=remote))
        return links

    def links(self) -> list[list[str]]:
        """GPU-to-GPU matrix: 'X' on the diagonal, 'NV#' for # active NVLinks, else PCIe level."""
        if self._links is not None:
            return self._links
        n = self.count
        static = [self.static_info(i) for i in range(n)]

        def nvlink_p2p(i: int, j: int) -> bool | None:
            value, reason = self.query(
                "nvmlDeviceGetP2PStatus", self._handles[i], self._handles[j], _P2P_CAPS_INDEX_NVLINK
            )
            return None if reason else value == _P2P_STATUS_OK

        nv = nvlink_counts(static, nvlink_p2p)
        matrix = [["X"] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                if nv[i][j]:
                    level = f"NV{nv[i][j]}"
                else:
                    value, reason = self.query(
                        "nvmlDeviceGetTopologyCommonAncestor", self._handles[i], self._handles[j]
                    )
                    level = TOPOLOGY_NAMES.get(value, "?") if reason is None else "?"
                matrix[i][j] = matrix[j][i] = level
        self._links = matrix
        return matrix

    # -- dynamic (every call) -------------------------------------------------------------------
    def sample(self, index: int, gpu: GpuInfo | None = None, *, processes: bool = False) -> GpuInfo:
        """Fill the fast-changing fields of one GPU (a copy of its static info unless given)."""
        if gpu is None:
            base = self.static_info(index)
            gpu = GpuInfo(**{k: getattr(base, k) for k in base.__dataclass_fields__})
            gpu.unavailable = dict(base.unavailable)
        h = self._handles[index]
        mem = self._get(gpu, "memory_used", "nvmlDeviceGetMemoryInfo", h)
        gpu.memory_used = int(mem.used) if mem is not None else None
        util = self._get(gpu, "util_gpu", "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            gpu.util_gpu, gpu.util_memory = float(util.gpu), float(util.memory)
        temp = self._get(gpu, "temperature_c", "nvmlDeviceGetTemperature", h, _TEMPERATURE_GPU)
        gpu.temperature_c = float(temp) if temp is not None else None
        power = self._get(gpu, "power_w", "nvmlDeviceGetPowerUsage", h)
        gpu.power_w = power / 1000.0 if power is not None else None
        gpu.clock_sm_mhz = self._get(gpu, "clock_sm_mhz", "nvmlDeviceGetClockInfo", h, _CLOCK_SM)
        gpu.clock_mem_mhz = self._get(gpu, "clock_mem_mhz", "nvmlDeviceGetClockInfo", h, _CLOCK_MEM)
        if processes:
            gpu.pcie_gen = self._get(gpu, "pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration", h)
            gpu.pcie_width = self._get(gpu, "pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", h)
            gpu.processes = self._processes(gpu, h)
        return gpu

    def _processes(self, gpu: GpuInfo, handle: Any) -> list[GpuProcess]:
        seen: dict[int, GpuProcess] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            procs, reason = self.query(fn, handle)
            if reason:
                gpu.unavailable.setdefault("processes", reason)
                continue
            for p in procs or []:
                pid = int(p.pid)
                used = getattr(p, "usedGpuMemory", None)
                seen[pid] = GpuProcess(pid=pid, name=_process_name(pid), used_memory=used)
        return sorted(seen.values(), key=lambda p: p.pid)

    def clock_events(self, index: int) -> tuple[tuple[str, ...] | None, str | None]:
        """Why GPU `index` runs below its top clock now: (reason names, None) or (None, why unknown).
        Drivers before r535 know the query by its older name (throttle reasons)."""
        self.start()
        if index >= len(self._handles):
            return None, f"no GPU {index}"
        h = self._handles[index]
        mask, reason = self.query("nvmlDeviceGetCurrentClocksEventReasons", h)
        if mask is None:
            mask, old_reason = self.query("nvmlDeviceGetCurrentClocksThrottleReasons", h)
            reason = reason if mask is None and (old_reason or "").endswith("missing from this nvidia-ml-py") else old_reason
        if mask is None:
            return None, reason
        return clock_event_names(int(mask)), None

    def processes(self, index: int) -> tuple[list[GpuProcess], str | None]:
        """The compute and graphics processes on GPU `index` now, and why the list may be incomplete."""
        self.start()
        if index >= len(self._handles):
            return [], f"no GPU {index}"
        gpu = GpuInfo(index=index)
        procs = self._processes(gpu, self._handles[index])
        return procs, gpu.unavailable.get("processes")

    def view(self) -> GpuView:
        """Everything `hw` shows about GPUs; never raises for a missing driver or GPU."""
        reason = self.start()
        if not self._handles:
            return GpuView(reason=reason or NO_GPU, at=time.time())
        gpus = [self.sample(i, processes=True) for i in range(self.count)]
        driver, cuda = self._versions
        return GpuView(
            gpus=gpus, links=self.links(), driver_version=driver, cuda_driver_version=cuda, at=time.time()
        )


def _process_name(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


_default: Nvml | None = None
_default_lock = threading.Lock()


def nvml() -> Nvml:
    """The process-wide NVML session (created on first use, initialised once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Nvml()
        return _default


def gpu_view() -> GpuView:
    return nvml().view()
