"""Before a launch: does the model fit on the chosen GPUs, are they free, does tp divide them?

Weights: the sum of the *.safetensors files of a local model directory (a model saved as .bin /
.pt only is summed from those), or a size given by the caller (the download plan's estimate from
hub metadata, `engine.download`). Target and drafter weights are both sharded over the tp GPUs.
Memory: each GPU offers `mem_fraction` of its total (SGLang's --mem-fraction-static plays this
role); after the weights a share `kv_min_fraction` of that must remain for the KV cache, or the
server starts with too little cache to batch (or dies allocating it).

`check_fit` returns a FitReport with the numbers; `require_fit` raises PreflightError (exit 2)
with those numbers in the message. `check_gpus` refuses a tp that does not divide the GPU set and
GPUs that other processes hold.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddtree.engine.errors import EngineError

GiB = 1024**3
WEIGHT_SUFFIXES = (".safetensors",)
FALLBACK_SUFFIXES = (".bin", ".pt", ".pth")
DEFAULT_MEM_FRACTION = 0.88
DEFAULT_KV_MIN_FRACTION = 0.10
# Memory held per GPU by something else before we start: a CUDA context of an idle process is a
# few hundred MiB, so more than this means another workload.
BUSY_BYTES = 2 * GiB


class PreflightError(EngineError):
    """The launch would not fit or not start on the chosen GPUs (bad input: choose others)."""

    exit_code = 2


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def model_weight_bytes(model: str | os.PathLike, *, hub_bytes: int | None = None) -> int | None:
    """Bytes of weights of a local model dir; `hub_bytes` (from hub metadata) for a repo id.
    None when neither is known (a hub id with no metadata given)."""
    path = Path(model)
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
        if not files:
            files = [p for p in path.rglob("*") if p.is_file() and p.name.endswith(FALLBACK_SUFFIXES)]
        if not files:
            raise PreflightError(f"{path} holds no weight files (*.safetensors)",
                                 "is the download complete? `ddtree-console download` resumes it")
        return sum(p.stat().st_size for p in files)
    if path.exists():
        raise PreflightError(f"{path} is a file, not a model directory")
    if str(model).startswith(("/", "./", "../", "~")):
        raise PreflightError(f"model directory {model} does not exist")
    return hub_bytes


@dataclass(frozen=True)
class FitReport:
    weights_bytes: int  # target + drafter
    tp: int
    gpu_total_bytes: int  # the smallest chosen GPU's total memory
    mem_fraction: float
    kv_min_fraction: float

    @property
    def per_gpu_weights(self) -> float:
        return self.weights_bytes / self.tp

    @property
    def per_gpu_budget(self) -> float:
        return self.gpu_total_bytes * self.mem_fraction

    @property
    def per_gpu_kv(self) -> float:
        return self.per_gpu_budget - self.per_gpu_weights

    @property
    def fits(self) -> bool:
        return self.per_gpu_kv >= self.kv_min_fraction * self.per_gpu_budget

    def describe(self) -> str:
        return (f"weights {_gb(self.weights_bytes)} over tp {self.tp} = {_gb(self.per_gpu_weights)} per GPU; "
                f"each GPU offers {_gb(self.per_gpu_budget)} ({self.mem_fraction:.2f} of "
                f"{_gb(self.gpu_total_bytes)}), leaving {_gb(max(self.per_gpu_kv, 0))} for the KV cache "
                f"(at least {_gb(self.kv_min_fraction * self.per_gpu_budget)} needed)")

    def to_dict(self) -> dict:
        return {"weights_bytes": self.weights_bytes, "tp": self.tp, "gpu_total_bytes": self.gpu_total_bytes,
                "mem_fraction": self.mem_fraction, "kv_min_fraction": self.kv_min_fraction,
                "per_gpu_weights": self.per_gpu_weights, "per_gpu_kv": self.per_gpu_kv, "fits": self.fits}


def check_fit(weights_bytes: int, gpu_total_bytes: Sequence[int], tp: int, *,
              mem_fraction: float = DEFAULT_MEM_FRACTION,
              kv_min_fraction: float = DEFAULT_KV_MIN_FRACTION) -> FitReport:
    if weights_bytes < 0:
        raise PreflightError(f"weights size must be >= 0, got {weights_bytes}")
    if not 0 < mem_fraction <= 1:
        raise PreflightError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    if not 0 <= kv_min_fraction < 1:
        raise PreflightError(f"kv_min_fraction must be in [0, 1), got {kv_min_fraction}")
    if tp < 1 or len(gpu_total_bytes) < tp:
        raise PreflightError(f"tp {tp} needs {tp} GPUs, {len(gpu_total_bytes)} given")
    chosen = list(gpu_total_bytes)[:tp]
    return FitReport(weights_bytes=int(weights_bytes), tp=tp, gpu_total_bytes=int(min(chosen)),
                     mem_fraction=mem_fraction, kv_min_fraction=kv_min_fraction)


def require_fit(report: FitReport, model: str = "the model") -> FitReport:
    if not report.fits:
        tp = report.tp * 2
        while tp <= 64 and not FitReport(report.weights_bytes, tp, report.gpu_total_bytes, report.mem_fraction,
                                         report.kv_min_fraction).fits:
            tp *= 2
        raise PreflightError(f"{model} does not fit: {report.describe()}",
                             f"use tp {tp} or GPUs with more memory" if tp <= 64 else "use GPUs with more memory")
    return report


def check_gpus(all_gpus: Sequence[int], tp: int, *, used_bytes: dict[int, int] | None = None,
               processes: dict[int, int] | None = None, visible: Sequence[int] | None = None) -> None:
    """Refuse a tp that does not divide the GPU set, GPUs that do not exist, and busy GPUs.

    used_bytes: memory in use per GPU index; processes: compute processes per GPU index;
    visible: the GPU indices this machine has (None: unknown, not checked)."""
    gpus = list(all_gpus)
    if tp < 1:
        raise PreflightError(f"tp must be >= 1, got {tp}")
    if not gpus:
        return
    if len(gpus) % tp:
        raise PreflightError(f"tp {tp} does not divide the {len(gpus)} GPUs {gpus}",
                             f"use tp in {[d for d in range(1, len(gpus) + 1) if len(gpus) % d == 0]}")
    if visible is not None:
        missing = [g for g in gpus if g not in set(visible)]
        if missing:
            raise PreflightError(f"GPU {', '.join(map(str, missing))} does not exist on this machine",
                                 f"this machine has GPUs {sorted(visible)}")
    busy = []
    for g in gpus:
        used = (used_bytes or {}).get(g)
        procs = (processes or {}).get(g, 0)
        if procs or (used is not None and used > BUSY_BYTES):
            busy.append(f"GPU {g} ({_gb(used or 0)} used, {procs} process{'es' if procs != 1 else ''})")
    if busy:
        raise PreflightError("GPUs in use: " + "; ".join(busy),
                             "stop what runs there (`ddtree-console jobs`), or choose other engine.gpus")


def preflight(model: str, draft: str | None, gpu_total_bytes: Sequence[int], tp: int, *,
              hub_bytes: dict[str, int] | None = None, mem_fraction: float = DEFAULT_MEM_FRACTION,
              kv_min_fraction: float = DEFAULT_KV_MIN_FRACTION) -> FitReport | None:
    """Fit check for one launch; None when a weight size is unknown (a hub id without metadata)."""
    sizes = []
    for name in (model, draft):
        if name is None:
            continue
        size = model_weight_bytes(name, hub_bytes=(hub_bytes or {}).get(name))
        if size is None:
            return None
        sizes.append(size)
    return require_fit(check_fit(sum(sizes), gpu_total_bytes, tp, mem_fraction=mem_fraction,
                                 kv_min_fraction=kv_min_fraction), model)
