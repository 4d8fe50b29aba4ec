"""What competes with a measurement: host load, other processes' CPU time, other GPU processes,
GPU clocks, clocks event (throttle) reasons and temperature.

A `Watch` is opened just before a sweep point and closed just after it; it returns a `Contention`
reading. "Ours" is this process, its process group, and the process groups and pids the caller
names (the engine's group); every other process on the host is someone else's. A process that
starts and exits inside the window is not seen, so `others_cpu_s` is a lower bound; the host's
CPU use over the window (`cpu_percent`, from /proc/stat deltas) covers everything.

Every GPU value goes through `engine.hw.Nvml`; a value that cannot be read is None with its reason
in `unavailable`, never a made-up number. `busy_reasons` turns a reading into the list of reasons
the point is contended (empty when it is not), against `Thresholds`; it is pure, so tests feed it
readings directly. No torch here: this runs on the machine side next to the runner.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil

from ddtree.engine.errors import EngineError
from ddtree.engine.machine.hw import Nvml, nvml
from ddtree.engine.units import plural

#: Clock event reasons that say nothing about competition: an idle GPU, clocks a user set.
BENIGN_CLOCK_EVENTS = frozenset({"gpu_idle", "applications_clocks_setting", "display_clock_setting", "sync_boost"})
TOP_OTHERS = 3  # the heaviest other processes kept in a reading, to name the culprit


class ThresholdError(EngineError):
    exit_code = 2


@dataclass(frozen=True)
class Thresholds:
    """When a point counts as contended."""

    others_cores: float = 0.10  # others' CPU seconds per wall second (0.10 = a tenth of one core)
    load_per_cpu: float = 1.0  # 1-min load average above this many per logical CPU
    cpu_percent: float | None = None  # host CPU use over the point; None: not a criterion (ours counts too)

    def __post_init__(self) -> None:
        if not self.others_cores > 0:
            raise ThresholdError(f"others_cores must be positive, got {self.others_cores}")
        if not self.load_per_cpu > 0:
            raise ThresholdError(f"load_per_cpu must be positive, got {self.load_per_cpu}")
        if self.cpu_percent is not None and not 0 < self.cpu_percent <= 100:
            raise ThresholdError(f"cpu_percent must be in (0, 100], got {self.cpu_percent}")


@dataclass(frozen=True)
class OtherProcess:
    pid: int
    name: str | None
    cpu_s: float


@dataclass(frozen=True)
class GpuPressure:
    """One GPU in use by the point, at the end of the window (other pids: seen at either end)."""

    index: int
    other_pids: tuple[int, ...] = ()
    clock_sm_mhz: int | None = None
    clock_sm_max_mhz: int | None = None
    temperature_c: float | None = None
    clock_events: tuple[str, ...] | None = None
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def slowdowns(self) -> tuple[str, ...]:
        return tuple(r for r in self.clock_events or () if r not in BENIGN_CLOCK_EVENTS)


@dataclass(frozen=True)
class Contention:
    wall_s: float
    cpus: int
    load1: float | None = None  # 1-min load average at the end of the window
    load1_start: float | None = None
    cpu_percent: float | None = None  # host CPU use over the window, all processes
    others_cpu_s: float | None = None  # CPU seconds of processes that are not ours during the window
    others_top: tuple[OtherProcess, ...] = ()
    gpus: tuple[GpuPressure, ...] = ()
    gpu_reason: str | None = None  # why no GPU was read (none in use, no NVML ...)
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def others_cores(self) -> float | None:
        """Others' CPU time per wall second: 1.0 is one core kept busy by someone else."""
        if self.others_cpu_s is None or self.wall_s <= 0:
            return None
        return self.others_cpu_s / self.wall_s

    def to_dict(self) -> dict:
        out = asdict(self)
        out["others_cores"] = self.others_cores
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Contention:
        data = dict(data)
        data["others_top"] = tuple(OtherProcess(**p) for p in data.get("others_top") or ())
        gpus = []
        for g in data.get("gpus") or ():
            g = dict(g)
            g["other_pids"] = tuple(g.get("other_pids") or ())
            if g.get("clock_events") is not None:
                g["clock_events"] = tuple(g["clock_events"])
            gpus.append(GpuPressure(**{k: v for k, v in g.items() if k in GpuPressure.__dataclass_fields__}))
        data["gpus"] = tuple(gpus)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def busy_reasons(c: Contention, thresholds: Thresholds | None = None) -> list[str]:
    """Why the box was busy during the reading (short phrases); empty when it was not."""
    t = thresholds or Thresholds()
    out = []
    cores = c.others_cores
    if cores is not None and cores > t.others_cores:
        top = f" (top: {c.others_top[0].name or c.others_top[0].pid})" if c.others_top else ""
        out.append(f"others {cores:.2f} cores{top}")
    load = max((x for x in (c.load1, c.load1_start) if x is not None), default=None)
    if load is not None and load > t.load_per_cpu * c.cpus:
        out.append(f"load {load:.1f} > {c.cpus} cpus")
    if t.cpu_percent is not None and c.cpu_percent is not None and c.cpu_percent > t.cpu_percent:
        out.append(f"cpu {c.cpu_percent:.0f}%")
    for g in c.gpus:
        if g.other_pids:
            out.append(f"gpu {g.index}: {plural(len(g.other_pids), 'other process', 'other processes')}")
        if g.slowdowns:
            out.append(f"gpu {g.index}: {', '.join(g.slowdowns)}")
    return out


def busy_note(reasons: list[str]) -> str | None:
    """The one-line note the pane header and the exports show."""
    return f"busy box: {'; '.join(reasons)}" if reasons else None


# -- reading -------------------------------------------------------------------------------------


def _load1() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _busy_total(times: Any) -> tuple[float, float]:
    idle = times.idle + getattr(times, "iowait", 0.0)
    total = sum(times)
    # guest time is already inside user on Linux; do not count it twice
    total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    return total - idle, total


def _cpu_percent(before: Any, after: Any) -> float | None:
    b_busy, b_total = _busy_total(before)
    a_busy, a_total = _busy_total(after)
    if a_total <= b_total:
        return None
    return max(0.0, min(100.0, 100.0 * (a_busy - b_busy) / (a_total - b_total)))


def _process_table() -> dict[int, tuple[float, float, str | None]]:
    """pid -> (create time, user + system CPU seconds, name) for every process we may read."""
    table = {}
    for proc in psutil.process_iter(["create_time", "cpu_times", "name"]):
        info = proc.info
        times = info.get("cpu_times")
        if times is None or info.get("create_time") is None:
            continue  # access denied or gone
        table[proc.pid] = (info["create_time"], times.user + times.system, info.get("name"))
    return table


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


class Watch:
    """Reads what competes with us between `start()` and `stop()` (or as a context manager)."""

    def __init__(self, *, our_pids: tuple[int, ...] = (), our_pgids: tuple[int, ...] = (),
                 gpus: tuple[int, ...] = (), session: Nvml | None = None) -> None:
        self.our_pids = {os.getpid(), *our_pids}
        self.our_pgids = {os.getpgid(0), *our_pgids}
        self.gpus = tuple(gpus)
        self._session = session
        self._t0 = 0.0
        self._start_wall = 0.0
        self._cpu0: Any = None
        self._load0: float | None = None
        self._procs0: dict[int, tuple[float, float, str | None]] = {}
        self._gpu_pids0: dict[int, set[int]] = {}
        self.reading: Contention | None = None

    def _ours(self, pid: int) -> bool:
        return pid in self.our_pids or _pgid(pid) in self.our_pgids

    def start(self) -> Watch:
        self._t0, self._start_wall = time.monotonic(), time.time()
        self._cpu0 = psutil.cpu_times()
        self._load0 = _load1()
        self._procs0 = _process_table()
        self._gpu_pids0 = {i: pids for i, pids in ((i, self._other_gpu_pids(i)[0]) for i in self.gpus)}
        return self

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> Contention:
        wall = time.monotonic() - self._t0
        cpu = _cpu_percent(self._cpu0, psutil.cpu_times())
        others: list[OtherProcess] = []
        for pid, (created, cpu_s, name) in _process_table().items():
            if self._ours(pid):
                continue
            then = self._procs0.get(pid)
            if then is not None and then[0] == created:
                used = cpu_s - then[1]
            elif created >= self._start_wall - 1.0:
                used = cpu_s  # started during the window: all its time is inside it
            else:
                continue  # a pid we could not read at the start: no honest delta
            if used > 0:
                others.append(OtherProcess(pid=pid, name=name, cpu_s=used))
        others.sort(key=lambda p: -p.cpu_s)
        gpus, gpu_reason = self._gpus()
        self.reading = Contention(
            wall_s=wall, cpus=psutil.cpu_count(logical=True) or 1, load1=_load1(), load1_start=self._load0,
            cpu_percent=cpu, others_cpu_s=sum(p.cpu_s for p in others), others_top=tuple(others[:TOP_OTHERS]),
            gpus=gpus, gpu_reason=gpu_reason,
            unavailable={} if self._load0 is not None else {"load1": "this platform has no load average"})
        return self.reading

    # -- GPUs --------------------------------------------------------------------------------
    def _nvml(self) -> Nvml:
        if self._session is None:
            self._session = nvml()
        return self._session

    def _other_gpu_pids(self, index: int) -> tuple[set[int], str | None]:
        session = self._nvml()
        if session.reason is not None:
            return set(), session.reason
        procs, reason = session.processes(index)
        return {p.pid for p in procs if not self._ours(p.pid)}, reason

    def _gpus(self) -> tuple[tuple[GpuPressure, ...], str | None]:
        if not self.gpus:
            return (), "the point uses no GPU"
        session = self._nvml()
        if session.reason is not None:
            return (), session.reason
        out = []
        for i in self.gpus:
            if i >= session.count:
                out.append(GpuPressure(index=i, unavailable={"gpu": f"NVML sees no GPU {i}"}))
                continue
            pids, reason = self._other_gpu_pids(i)
            g = session.sample(i)
            events, events_reason = session.clock_events(i)
            missing = {k: v for k, v in g.unavailable.items()
                       if k in ("clock_sm_mhz", "clock_sm_max_mhz", "temperature_c")}
            if reason:
                missing["processes"] = reason
            if events_reason:
                missing["clock_events"] = events_reason
            out.append(GpuPressure(index=i, other_pids=tuple(sorted(pids | self._gpu_pids0.get(i, set()))),
                                   clock_sm_mhz=g.clock_sm_mhz, clock_sm_max_mhz=g.clock_sm_max_mhz,
                                   temperature_c=g.temperature_c, clock_events=events, unavailable=missing))
        return tuple(out), None


def box_now(window_s: float = 0.25, *, gpus: tuple[int, ...] | None = None, session: Nvml | None = None) -> Contention:
    """The box right now, over a short window (the dry run's check): every process but this one
    counts as someone else's. `gpus` None reads every GPU NVML sees."""
    reason = None
    if gpus is None:
        session = session or nvml()
        reason = session.reason
        gpus = tuple(range(session.count)) if reason is None else ()
    watch = Watch(gpus=gpus, session=session).start()
    time.sleep(window_s)
    reading = watch.stop()
    return replace(reading, gpu_reason=reason) if reason else reading
