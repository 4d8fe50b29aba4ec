"""GPU and host telemetry at a set rate, with bounded cost.

A tick reads only fast-changing values (NVML utilisation, memory, power, temperature, SM clock per
GPU; CPU and memory use of the host); names, limits and topology stay cached in `Nvml`. The sampler
measures the CPU time each tick costs and stretches its interval whenever the cost would exceed
`max_duty` of one core (1% by default), so a slow driver cannot make it a load of its own.

It knows no schema: it yields samples, or hands each to a `sink` (the store's
`ddtree.store.telemetry.TelemetryWriter`, whose CPU time counts as the sampler's own) and/or an
`on_sample` callback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from ddtree.engine.errors import EngineError
from ddtree.engine.machine.hw import Nvml, nvml

class SamplerConfigError(EngineError):
    exit_code = 2


@dataclass(frozen=True)
class GpuSample:
    index: int
    util: float | None
    mem_used: int | None
    mem_total: int | None
    power_w: float | None
    temperature_c: float | None
    clock_sm_mhz: int | None


@dataclass(frozen=True)
class TelemetrySample:
    at: float  # unix time
    gpus: list[GpuSample] = field(default_factory=list)
    cpu_percent: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    cost_s: float = 0.0  # CPU time this sample took

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplerConfig:
    rate_hz: float = 1.0
    max_duty: float = 0.01  # most CPU time per wall second the sampler may use
    host: bool = True

    def __post_init__(self) -> None:
        if not (0 < self.rate_hz <= 100):
            raise SamplerConfigError(f"sample rate must be in (0, 100] Hz, got {self.rate_hz}")
        if not (0 < self.max_duty <= 1):
            raise SamplerConfigError(f"max_duty must be in (0, 1], got {self.max_duty}")


class Sampler:
    def __init__(self, config: SamplerConfig | None = None, *, session: Nvml | None = None) -> None:
        self.config = config or SamplerConfig()
        self._nvml = session if session is not None else nvml()
        self._cost_ema: float | None = None
        self.ticks = 0
        self.cpu_s = 0.0  # total CPU time spent sampling
        if self.config.host:
            psutil.cpu_percent(interval=None)  # primes the counter: the first reading is since now

    @property
    def interval_s(self) -> float:
        """The wait between ticks: the set rate, stretched when ticks cost more than allowed."""
        base = 1.0 / self.config.rate_hz
        if self._cost_ema is None:
            return base
        return max(base, self._cost_ema / self.config.max_duty)

    def sample(self) -> TelemetrySample:
        t0 = time.thread_time()
        gpus = []
        if self._nvml.reason is None:
            for i in range(self._nvml.count):
                g = self._nvml.sample(i)
                gpus.append(GpuSample(index=i, util=g.util_gpu, mem_used=g.memory_used, mem_total=g.memory_total,
                                      power_w=g.power_w, temperature_c=g.temperature_c,
                                      clock_sm_mhz=g.clock_sm_mhz))
        cpu = mem_used = mem_total = None
        if self.config.host:
            cpu = psutil.cpu_percent(interval=None)
            vm = psutil.virtual_memory()
            mem_used, mem_total = vm.total - vm.available, vm.total
        cost = time.thread_time() - t0
        self._account(cost)
        return TelemetrySample(at=time.time(), gpus=gpus, cpu_percent=cpu, mem_used=mem_used, mem_total=mem_total,
                      cost_s=cost)

    def _account(self, cost: float) -> None:
        self.ticks += 1
        self.cpu_s += cost
        self._cost_ema = cost if self._cost_ema is None else 0.8 * self._cost_ema + 0.2 * cost

    def samples(self, stop: threading.Event) -> Iterator[TelemetrySample]:
        """Yield a sample every interval until `stop` is set (the first one at once)."""
        next_at = time.monotonic()
        while not stop.is_set():
            yield self.sample()
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # fell behind (a slow consumer): do not burst to catch up
                next_at = now + self.interval_s
            if stop.wait(next_at - now):
                return

    def run(self, stop: threading.Event, *, sink: Callable[[TelemetrySample], Any] | None = None,
            on_sample: Callable[[TelemetrySample], None] | None = None) -> None:
        """Sample until `stop` is set, handing each sample to `sink` (a store writer: its CPU time
        is counted in `cpu_s`) and then to `on_sample`."""
        for s in self.samples(stop):
            if sink is not None:
                t0 = time.thread_time()
                sink(s)
                self.cpu_s += time.thread_time() - t0
            if on_sample is not None:
                on_sample(s)

    def start(self, stop: threading.Event, **kwargs: Any) -> threading.Thread:
        """`run` on a daemon thread. A sink that writes to a database must own a connection that
        allows use from that thread."""
        thread = threading.Thread(target=self.run, args=(stop,), kwargs=kwargs, name="ddtree-sampler", daemon=True)
        thread.start()
        return thread
