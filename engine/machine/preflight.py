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

`estimate_vram` is the finer estimate for a local model (`ddtree-console hw --fit`): weights from
the safetensors headers (shapes x dtype sizes, read without torch), KV cache per token from
config.json (layers x kv heads x head_dim x 2 x dtype bytes; MLA's latent for DeepSeek/Kimi),
times context x concurrency, per GPU at a tp size against the chosen GPUs' memory.
"""

from __future__ import annotations

import json
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
# Bounds for the estimate's inputs: past them a typo, not a plan (no model reads 16M tokens, no
# server runs a million sequences at once or spans 1024 GPUs with one tp group).
MAX_CONTEXT = 1 << 24
MAX_CONCURRENCY = 1 << 20
MAX_TP = 1024


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


# -- VRAM estimate from the safetensors headers and config.json ---------------------------------
# Bytes per element of the safetensors dtypes (the header's "dtype" strings).
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
CONFIG_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                      "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2}
MAX_HEADER_BYTES = 100 * 1024**2  # the safetensors format's own limit


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON), without
    reading the tensors and without torch or the safetensors package."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise PreflightError(f"{path} is not a safetensors file (shorter than its header)")
            length = int.from_bytes(raw, "little")
            size = path.stat().st_size
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise PreflightError(f"{path} is not a safetensors file (header length {length}, file {size} bytes)",
                                     "a truncated download? rerun `ddtree-console download` to resume")
            raw = f.read(length)
    except OSError as exc:
        raise PreflightError(f"cannot read {path}: {exc.strerror}") from None
    return _json_object(raw, path, "a safetensors file", "its header is ")


def _json_object(raw: bytes, path: Path, what: str, part: str = "") -> dict:
    """`raw` (read from `path`) parsed as a JSON object, else a PreflightError:
    "<path> is not <what> (<part>not JSON)", or "... not a JSON object"."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise PreflightError(f"{path} is not {what} ({part}not JSON)") from None
    if not isinstance(data, dict):
        raise PreflightError(f"{path} is not {what} ({part}not a JSON object)")
    return data


@dataclass(frozen=True)
class WeightInfo:
    bytes: int  # tensor data, from shapes x dtype sizes
    params: int
    dtypes: dict[str, int]  # dtype -> bytes of tensors in it
    files: int

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "params": self.params, "dtypes": dict(self.dtypes), "files": self.files}


def safetensors_weights(model_dir: str | os.PathLike) -> WeightInfo:
    """Weights of a local model from its safetensors headers: parameters x dtype bytes per tensor
    (the files' own sizes add headers and padding, and a quantised model's scales show as their dtype)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise PreflightError(f"model directory {model_dir} does not exist" if not path.exists()
                             else f"{path} is a file, not a model directory")
    files = sorted(p for p in path.rglob("*.safetensors") if p.is_file())
    if not files:
        raise PreflightError(f"{path} holds no weight files (*.safetensors)",
                             "is the download complete? `ddtree-console download` resumes it")
    total = params = 0
    dtypes: dict[str, int] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape = entry["dtype"], entry["shape"]
                count = 1
                for dim in shape:
                    count *= int(dim)
                if dtype in DTYPE_BYTES:
                    nbytes = count * DTYPE_BYTES[dtype]
                else:  # sub-byte or new dtypes: the data offsets say how much they hold
                    start, end = entry["data_offsets"]
                    nbytes = int(end) - int(start)
            except (KeyError, TypeError, ValueError):
                raise PreflightError(f"{file}: tensor {name!r} has a malformed header entry") from None
            total += nbytes
            params += count
            dtypes[dtype] = dtypes.get(dtype, 0) + nbytes
    return WeightInfo(bytes=total, params=params, dtypes=dtypes, files=len(files))


def _text_config(config: dict) -> dict:
    # multimodal configs nest the language model's fields
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict) and "num_hidden_layers" in config[key]:
            return config[key]
    return config


def load_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PreflightError(f"{model_dir} has no config.json", "is the download complete?") from None
    except OSError as exc:
        raise PreflightError(f"cannot read {path}: {exc.strerror}") from None
    return _json_object(raw, path, "a model config")


@dataclass(frozen=True)
class KvLayout:
    layers: int
    kv_heads: int  # 1 for MLA's shared latent
    head_dim: int  # per head, K and V together counted by `factor`
    factor: int  # 2 (K and V) for MHA/GQA, 1 for MLA's latent (which holds both)
    dtype_bytes: int
    mla: bool = False
    attention_heads: int | None = None  # query heads (num_attention_heads), None when the config has none

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * self.factor * self.dtype_bytes

    def per_gpu_per_token(self, tp: int) -> float:
        # KV heads split over tp; fewer heads than GPUs are replicated (one per GPU), and MLA's
        # latent is replicated on every GPU (SGLang without DP attention)
        if self.mla:
            return float(self.bytes_per_token)
        return self.bytes_per_token / tp if self.kv_heads >= tp else float(self.bytes_per_token) / self.kv_heads

    def tp_split_problem(self, tp: int) -> str | None:
        """Why SGLang and vLLM would refuse this tp for these KV heads, or None: each splits the heads
        evenly over tp (kv_heads % tp == 0) or gives every head the same number of GPUs
        (tp % kv_heads == 0). MLA's one latent is replicated, which any tp allows."""
        if self.mla or tp <= 1 or (self.kv_heads % tp == 0 if self.kv_heads >= tp else tp % self.kv_heads == 0):
            return None
        return (f"tp {tp} cannot split {self.kv_heads} KV heads evenly (SGLang and vLLM need one to divide the "
                f"other), so a server refuses this tp; the KV figures assume it could")

    def tp_attention_problem(self, tp: int) -> str | None:
        """Why SGLang and vLLM would refuse this tp for these attention (query) heads, or None: both
        shard the query heads evenly over tp, so tp must divide num_attention_heads (MLA models too)."""
        if tp <= 1 or not self.attention_heads or self.attention_heads % tp == 0:
            return None
        return (f"tp {tp} cannot split {self.attention_heads} attention heads evenly (SGLang and vLLM need tp to "
                f"divide them), so a server refuses this tp; the figures assume it could")

    def tp_problems(self, tp: int) -> list[str]:
        """Every reason SGLang and vLLM would refuse this tp for this attention layout (attention heads,
        then KV heads); empty when they would serve it."""
        return [p for p in (self.tp_attention_problem(tp), self.tp_split_problem(tp)) if p]

    def to_dict(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "factor": self.factor,
                "dtype_bytes": self.dtype_bytes, "mla": self.mla, "attention_heads": self.attention_heads,
                "bytes_per_token": self.bytes_per_token}


def kv_layout(config: dict, *, kv_dtype_bytes: int | None = None) -> KvLayout:
    """KV cache size per token from an HF config: layers x kv heads x head_dim x 2 x dtype bytes
    (MLA models, DeepSeek/Kimi: layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes)."""
    cfg = _text_config(config)

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PreflightError(f"the model config has no valid {key} ({value!r})",
                                 "the VRAM estimate needs a decoder config (config.json)")
        return value

    if kv_dtype_bytes is None:
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype")
                   or config.get("dtype") or "bfloat16")
        kv_dtype_bytes = CONFIG_DTYPE_BYTES.get(name.removeprefix("torch."), 2)
        kv_dtype_bytes = max(kv_dtype_bytes, 2)  # fp8 weights still keep a bf16 KV cache unless told otherwise
    if kv_dtype_bytes not in (1, 2, 4):
        raise PreflightError(f"KV dtype bytes must be 1, 2 or 4, got {kv_dtype_bytes}")
    layers = need("num_hidden_layers")
    if cfg.get("kv_lora_rank"):
        latent = need("kv_lora_rank") + int(cfg.get("qk_rope_head_dim") or 0)
        heads = cfg.get("num_attention_heads")
        heads = heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None
        return KvLayout(layers, 1, latent, 1, kv_dtype_bytes, mla=True, attention_heads=heads)
    heads = need("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or need("hidden_size") // heads
    if not isinstance(kv_heads, int) or kv_heads <= 0 or not isinstance(head_dim, int) or head_dim <= 0:
        raise PreflightError(f"the model config has bad num_key_value_heads/head_dim ({kv_heads!r}/{head_dim!r})")
    return KvLayout(layers, kv_heads, head_dim, 2, kv_dtype_bytes, attention_heads=heads)


@dataclass(frozen=True)
class VramEstimate:
    model: str
    weights: WeightInfo
    draft_weights: WeightInfo | None
    kv: KvLayout
    context: int
    concurrency: int
    tp: int
    gpu_total_bytes: int  # the smallest chosen GPU
    mem_fraction: float

    @property
    def weights_bytes(self) -> int:
        return self.weights.bytes + (self.draft_weights.bytes if self.draft_weights else 0)

    @property
    def kv_bytes(self) -> int:
        """KV cache of the whole batch (context x concurrency tokens), before the tp split."""
        return self.kv.bytes_per_token * self.context * self.concurrency

    @property
    def per_gpu_weights(self) -> float:
        return self.weights_bytes / self.tp

    @property
    def per_gpu_kv(self) -> float:
        return self.kv.per_gpu_per_token(self.tp) * self.context * self.concurrency

    @property
    def per_gpu_needed(self) -> float:
        return self.per_gpu_weights + self.per_gpu_kv

    @property
    def per_gpu_budget(self) -> float:
        return self.gpu_total_bytes * self.mem_fraction

    @property
    def fits(self) -> bool:
        return self.per_gpu_needed <= self.per_gpu_budget

    @property
    def max_tokens(self) -> int:
        """KV tokens (context x concurrency) the budget leaves room for after the weights."""
        per_token = self.kv.per_gpu_per_token(self.tp)
        return max(0, int((self.per_gpu_budget - self.per_gpu_weights) // per_token)) if per_token else 0

    @property
    def notes(self) -> list[str]:
        """What makes the figures doubtful for a real server (a tp the engines refuse)."""
        return self.kv.tp_problems(self.tp)

    def describe(self) -> str:
        draft = f" + drafter {_gb(self.draft_weights.bytes)}" if self.draft_weights else ""
        return (f"weights {_gb(self.weights.bytes)}{draft} ({self.weights.params / 1e9:.2f} B params) over tp {self.tp} "
                f"= {_gb(self.per_gpu_weights)} per GPU; KV {self.kv.bytes_per_token / 1024:.1f} KiB/token x "
                f"{self.context} context x {self.concurrency} concurrent = {_gb(self.per_gpu_kv)} per GPU; "
                f"needs {_gb(self.per_gpu_needed)} of {_gb(self.per_gpu_budget)} per GPU "
                f"({self.mem_fraction:.2f} of {_gb(self.gpu_total_bytes)}): "
                + ("fits" if self.fits else "does NOT fit")
                + f"; room for {self.max_tokens:,} KV tokens")

    def to_dict(self) -> dict:
        return {"model": self.model, "weights": self.weights.to_dict(),
                "draft_weights": self.draft_weights.to_dict() if self.draft_weights else None,
                "kv": self.kv.to_dict(), "context": self.context, "concurrency": self.concurrency, "tp": self.tp,
                "gpu_total_bytes": self.gpu_total_bytes, "mem_fraction": self.mem_fraction,
                "weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes,
                "per_gpu_weights": self.per_gpu_weights, "per_gpu_kv": self.per_gpu_kv,
                "per_gpu_needed": self.per_gpu_needed, "per_gpu_budget": self.per_gpu_budget,
                "max_tokens": self.max_tokens, "fits": self.fits, "notes": self.notes}


def estimate_vram(model_dir: str | os.PathLike, gpu_total_bytes: Sequence[int], tp: int = 1, *,
                  context: int = 8192, concurrency: int = 1, draft_dir: str | os.PathLike | None = None,
                  kv_dtype_bytes: int | None = None, mem_fraction: float = DEFAULT_MEM_FRACTION) -> VramEstimate:
    """Weights (safetensors headers) + KV cache (config) per GPU against the chosen GPUs' memory.
    The drafter's own KV cache is small (a few layers over one block) and is not counted."""
    if not isinstance(context, int) or not 1 <= context <= MAX_CONTEXT:
        raise PreflightError(f"context must be 1..{MAX_CONTEXT:,} tokens, got {context!r}")
    if not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise PreflightError(f"concurrency must be 1..{MAX_CONCURRENCY:,}, got {concurrency!r}")
    if not 0 < mem_fraction <= 1:
        raise PreflightError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    if not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
        raise PreflightError(f"tp must be 1..{MAX_TP}, got {tp!r}")
    if len(gpu_total_bytes) < tp:
        raise PreflightError(f"tp {tp} needs {tp} GPUs, {len(gpu_total_bytes)} given")
    weights = safetensors_weights(model_dir)
    kv = kv_layout(load_config(model_dir), kv_dtype_bytes=kv_dtype_bytes)
    draft = safetensors_weights(draft_dir) if draft_dir is not None else None
    return VramEstimate(model=str(model_dir), weights=weights, draft_weights=draft, kv=kv, context=context,
                        concurrency=concurrency, tp=tp, gpu_total_bytes=int(min(list(gpu_total_bytes)[:tp])),
                        mem_fraction=mem_fraction)
