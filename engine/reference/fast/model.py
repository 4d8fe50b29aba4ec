"""Our own forward for dense pure-attention decoders (Qwen3, Llama, Qwen2, Mistral without a window).

The module tree and parameter names are those of the Hugging Face checkpoints, so a checkpoint's
safetensors load by name, without transformers. The math follows the transformers reference
(RMSNorm statistics in float32, RoPE tables computed in float32 then cast to the model dtype,
SwiGLU MLP) so that logits match `target.Target` to float rounding.

Attention never repeats K/V heads: the queries of one KV group are folded into the query length
([kv_heads, groups*n, d] against [kv_heads, rows, d]) with the mask repeated per group. SDPA's
`enable_gqa=True` would do the same without the fold, but together with a mask it drops to the
math backend on CUDA, which materialises every score; folded, the fused kernels stay eligible.

Three attention kernels (AttentionPlan.kernel): "sdpa"; "matmul": scores from one batched GEMM
with float32 output, softmax in float32, probabilities back in the model dtype for the second
GEMM (the roundings flash attention makes). For a few queries over a long cache the GEMMs read K
and V at full bandwidth, where the fused SDPA kernels give a handful of thread blocks the whole
cache each (on an H200, cuDNN's took 89 us a layer for one query over 4k rows); and "triton"
(fast/tree_attention.py): one fused split-key kernel that reads the context length and the tree
on the device, for the static paths only (eager forwards then take matmul or sdpa). With it, the
new rows' q/k norms, RoPE and cache writes are one kernel too (fast/rope_write.py).

One-row products (a decode step's) go through fast/gemv.py: a GEMV kernel for the weight shapes
where it measured faster than cuBLAS at warm-up, F.linear everywhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.engine.reference.errors import BadParams, ModelLoadError
from ddtree.engine.reference.fast import tree_attention as fused
from ddtree.engine.reference.fast.gemv import ACTIVATIONS as _ACTIVATIONS
from ddtree.engine.reference.fast.gemv import Gemv, plain
from ddtree.engine.reference.fast.rope_write import rope_write
from ddtree.engine.reference.rope import scale_inv_freq

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# SDPA's GQA flag (torch 2.5+); only the mask-free causal prefill uses it.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
_FUSED_RMS_NORM = hasattr(F, "rms_norm")


# ---- config -------------------------------------------------------------------------------------
def _rope_dict(config: dict) -> dict:
    """One flat RoPE description {rope_type, rope_theta?, factor?, ...} from either config layout."""
    params = config.get("rope_parameters")
    out: dict = {}
    if isinstance(params, dict):
        out.update(params)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        for key, value in scaling.items():
            out.setdefault(key, value)
    if "rope_theta" in config and config["rope_theta"] is not None:
        out.setdefault("rope_theta", config["rope_theta"])
    kind = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = str(kind)
    out.pop("type", None)
    return out


def _sliding_reason(config: dict, model_type: str) -> str | None:
    window = config.get("sliding_window", 4096 if model_type == "mistral" else None)
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False) or config.get("layer_types"):
            return None  # layer_types (checked before this) are the ground truth when present
        if config["num_hidden_layers"] <= int(config.get("max_window_layers", 28)):
            return None
    elif model_type != "mistral":
        return None
    if window is None:
        return None
    max_pos = config.get("max_position_embeddings")
    if isinstance(max_pos, int) and int(window) >= max_pos:
        return None  # a window as long as every position the model takes never slides
    return f"{model_type} uses sliding-window attention (sliding_window={window})"


def unsupported_reason(config: Any) -> str | None:
    """Why the fast backend cannot run this config.json dict (one line), or None if it can."""
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    model_type = str(config.get("model_type") or "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type or '(none)'!r} is not a dense decoder the fast backend knows "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        return f"config lacks {', '.join(missing)}"
    for key in (*_REQUIRED, "num_key_value_heads"):
        value = config.get(key)
        if key == "num_key_value_heads" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{key} must be a positive integer, got {value!r}"
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "quantized")
        return f"quantized checkpoints ({method}) are not supported"
    layer_types = config.get("layer_types")
    if layer_types:
        odd = sorted({str(t) for t in layer_types} - {"full_attention"})
        if odd:
            return f"{model_type} has non-full-attention layers ({', '.join(odd)})"
    sliding = _sliding_reason(config, model_type)
    if sliding:
        return sliding
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if not config.get("head_dim") and config["hidden_size"] % heads:
        return "hidden_size is not a multiple of num_attention_heads and head_dim is not set"
    if head_dim % 2:
        return f"head_dim {head_dim} is odd; RoPE needs pairs"
    act = config.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        return f"hidden_act {act!r} is not supported ({', '.join(sorted(_ACTIVATIONS))})"
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        return "per-layer-type rope_parameters are not supported"
    rope = _rope_dict(config)
    kind = rope["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        return f"rope type {kind!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary embeddings (partial_rotary_factor < 1) are not supported"
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(kind, ())
    lacking = [k for k in needs if k not in rope]
    if lacking:
        return f"rope type {kind} lacks {', '.join(lacking)}"
    return None


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # linear: factor; llama3: factor, low/high_freq_factor, original_max_position_embeddings.
    rope_scaling: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"target config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("target config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelLoadError(f"target config: head_dim {self.head_dim} is odd; RoPE needs pairs")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"target config: unsupported rope type {self.rope_type!r}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(f"target config: unsupported hidden_act {self.hidden_act!r}")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DecoderConfig:
        """Read a Hugging Face config.json dict; ModelLoadError says why when it is not supported."""
        reason = unsupported_reason(config)
        if reason:
            raise ModelLoadError(f"the fast backend cannot run this target: {reason}",
                                 "use the transformers backend")
        model_type = config["model_type"]
        heads = config["num_attention_heads"]
        rope = _rope_dict(config)
        attention_bias = bool(config.get("attention_bias", False))
        scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
        if rope["rope_type"] == "llama3":
            scaling.setdefault("original_max_position_embeddings",
                               config.get("max_position_embeddings", 8192))
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_type=rope["rope_type"],
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            # transformers' Qwen2 always has q/k/v biases and no o_proj bias; Mistral has none.
            qkv_bias=True if model_type == "qwen2" else attention_bias and model_type != "mistral",
            o_bias=attention_bias and model_type in ("llama", "qwen3"),
            mlp_bias=bool(config.get("mlp_bias", False)) and model_type == "llama",
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=config.get("hidden_act", "silu"),
            rope_scaling=scaling,
        )


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, computed as transformers does (in float32, on CPU)."""
    dim = cfg.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / dim))
    inv_freq = scale_inv_freq(inv_freq, cfg.rope_type, cfg.rope_scaling)
    return inv_freq


# ---- forward plan -------------------------------------------------------------------------------
@dataclass
class AttentionPlan:
    """Where one forward's n new K/V rows go and what every query sees; shared by all layers.

    rows: a slice (eager) or a LongTensor [n] of row indices (static path, index_copy_).
    read: attend over rows [:read] of the cache, or all rows when None.
    mask: additive [1, 1, groups*n, S] in the model dtype (already folded per KV group), or None
          when every query sees every row it reads (a single-token step).
    fresh: an empty cache and a causal block: attend among the new rows only, causal, no mask.
    kernel: "sdpa", "matmul" or "triton" (see the module docstring); the mask is float32 for
    "matmul"; "triton" takes no mask but `lengths` and `tree` (and `read` bounds the rows).
    lengths: [1] long, the context rows before the new ones (the cache's device length).
    tree: [1, n, n] bool visibility among the new rows, or None when they all see each other.
    """
    rows: slice | torch.Tensor
    read: int | None
    mask: torch.Tensor | None
    fresh: bool = False
    kernel: str = "sdpa"
    lengths: torch.Tensor | None = None
    tree: torch.Tensor | None = None


@dataclass
class BatchPlan:
    """A batched forward over a KV pool's slots 0..b-1 (fast/pool.py, fast/batch.py): b rows of q
    queries each, flattened to b*q tokens for every GEMM; attention per row, over its own slot.

    slots/rows: [b, q] long, where each new K/V goes (slot r, row length_r + j).
    read: attend over rows [:read] of every slot; 0: the slots are empty and each row attends
    causally among its own new rows (a prompt's prefill; mask None).
    mask: additive [b, 1, groups*q, read] (folded per KV group), in float32 for "matmul"; None
    for "triton", which reads `lengths` [b] and `tree` [b, q, q] instead (as AttentionPlan's).
    index: [b] long on the device, the pool slot each row attends over, when that is not slot r
    for row r (a prefill chunk riding in a round, MixedPlan); the writes follow `slots` either way.
    segments: prompts packed into one row (b 1, read 0; fast/prefill.py): int32 cumulative token
    counts on the device, the bounds of the prompts and then of the padding (entries past those
    repeat q: empty segments); each token attends causally within its own segment.
    segment_lengths: the segments' token counts on the host, for the loop over them; None where
    packed_attention_works (one varlen flash kernel, which a CUDA graph can capture).
    """
    b: int
    q: int
    slots: torch.Tensor
    rows: torch.Tensor
    read: int
    mask: torch.Tensor | None
    kernel: str = "sdpa"
    lengths: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    index: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    segment_lengths: tuple[int, ...] | None = None


@dataclass
class MixedPlan:
    """One forward over a pool whose tokens are several BatchPlans' in a row (a round's b*q, then
    a prefill chunk's): every GEMM takes all the tokens, so the weights stream once; attention
    runs per part. slots/rows: every token's write position, [n] each (the parts' in order)."""
    parts: tuple[BatchPlan, ...]
    slots: torch.Tensor
    rows: torch.Tensor

    @property
    def kernel(self) -> str:
        return self.parts[0].kernel


def matmul_attention_works(device: torch.device) -> bool:
    """Whether this torch has bmm with a float32 output for half inputs on this device (CUDA)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.zeros((1, 1, 8), dtype=torch.bfloat16, device=device)
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):  # a torch without out_dtype for bmm
        return False


ATTENTION_SETTINGS = ("auto", "sdpa", "matmul", "triton")


_PACKED_WORKS: dict[tuple, bool] = {}


def packed_attention_works(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                           head_dim: int) -> bool:
    """Whether flash attention's varlen kernel runs here for this shape (CUDA, half precision,
    a head size it has): tried once on a few tokens."""
    key = (device, dtype, heads, kv_heads, head_dim)
    if key not in _PACKED_WORKS:
        works = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
        if works:
            try:
                # Views of one [n, heads + 2 kv_heads, d] tensor, as Attention._packed gets them.
                qkv = torch.zeros((4, heads + 2 * kv_heads, head_dim), dtype=dtype, device=device)
                q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
                cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
                torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 4, 4, 0.0, True, False,
                                                        scale=head_dim ** -0.5)  # as Attention._packed calls it
            except (RuntimeError, AttributeError, NotImplementedError, TypeError):
                works = False
        _PACKED_WORKS[key] = works
    return _PACKED_WORKS[key]


def choose_attention(setting: str, device: torch.device, head_dim: int) -> str:
    """The kernel an attention setting names here: "auto" takes triton on CUDA where triton is
    installed and the head size suits it, else matmul where matmul_attention_works, else sdpa.
    BadParams for an unknown setting, or triton where it cannot run."""
    if setting not in ATTENTION_SETTINGS:
        raise BadParams(f"attention must be {', '.join(ATTENTION_SETTINGS)}, got {setting!r}")
    if setting == "triton" and not fused.runs(device, head_dim):
        raise BadParams(f"the triton attention kernel cannot run here (head_dim {head_dim}, {device.type})",
                        "it needs triton, CUDA and a power-of-two head size of 16..256")
    if setting == "auto":
        if device.type == "cuda" and fused.runs(device, head_dim):
            return "triton"
        return "matmul" if matmul_attention_works(device) else "sdpa"
    return setting


def eager_kernel(kernel: str, device: torch.device) -> str:
    """The kernel an eager forward takes under a static path's kernel: triton's reads device
    lengths that eager forwards do not keep, so they take matmul where it works, else sdpa."""
    if kernel != "triton":
        return kernel
    return "matmul" if matmul_attention_works(device) else "sdpa"


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [b, m, d] @ k [b, S, d]^T -> float32 [b, m, S], accumulated and stored in float32."""
    if q.dtype == torch.float32:
        return torch.bmm(q, k.transpose(1, 2))
    if q.is_cuda:
        return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(q.float(), k.float().transpose(1, 2))  # CPU: no half->float GEMM output


def matmul_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """The "matmul" kernel: q [b, m, d] over keys/values [b, S, d] -> [b, m, d]. mask broadcasts
    over the scores [b, m, S]: additive float32, or bool with True where visible."""
    scores = _scores(q, keys).mul_(scale)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores += mask
    return torch.bmm(torch.softmax(scores, dim=-1).to(values.dtype), values)


def fold_mask(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """bool [n, S] (True = visible) -> additive [1, 1, groups*n, S] for the folded queries.

    dtype: the model dtype for SDPA, float32 for the matmul kernel.
    """
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    additive.masked_fill_(~visible, float("-inf"))
    if groups > 1:
        additive = additive.repeat(groups, 1)
    return additive[None, None]


# ---- modules ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Statistics in float32, rounded to the model dtype before the weight (as Qwen3/Llama do).

    F.rms_norm on the float32 copy is the same arithmetic in one fused kernel where torch has it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _FUSED_RMS_NORM and x.is_cuda:
            # One kernel instead of four (upcast, norm, downcast, scale): a graph replay is
            # launch-bound on these small ops. It accumulates in float32 and rounds once, where
            # the reference rounds before the weight too: at most one bf16 ulp apart.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        if _FUSED_RMS_NORM:
            normed = F.rms_norm(x32, (x32.shape[-1],), eps=self.eps)
        else:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    linear = staticmethod(plain)  # DenseDecoder sets its Gemv (one-row products) here
    fused_writes = True  # static triton paths: norm, RoPE and cache writes in one kernel (rope_write)

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()

    def fuse(self) -> None:
        """One [q; k; v] weight for one GEMM instead of three; the three projections become views
        of it, so the state_dict keeps the checkpoint's names and values."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv = _fuse_linears(projs)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: AttentionPlan, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, H]; cos/sin [n, 1, d]; k_cache/v_cache [kv_heads, rows, d] (written in place).
        norm: applied to x first; residual: added to the output. Both ride on the q/k/v and o
        products (the GEMV kernel folds them in where it runs a one-row product)."""
        n = x.shape[0]
        d, kvh, g = self.head_dim, self.num_kv_heads, self.groups
        if self.fused_writes and self.qkv is not None and plan.kernel == "triton" and (
                isinstance(plan, MixedPlan) or
                (plan.read != 0 or plan.segments is not None if isinstance(plan, BatchPlan)
                 else not (plan.fresh or isinstance(plan.rows, slice)))):
            return self._fused(self.linear(x, *self.qkv, norm), cos, sin, k_cache, v_cache, plan, residual)
        if self.qkv is not None:
            q, k, v = self.linear(x, *self.qkv, norm).split([self.num_heads * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.view(n, self.num_heads, d), k.view(n, kvh, d), v.view(n, kvh, d)
        else:
            if norm is not None:
                x = norm(x)
            q = self.q_proj(x).view(n, self.num_heads, d)
            k = self.k_proj(x).view(n, kvh, d)
            v = self.v_proj(x).view(n, kvh, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE on queries and keys at once: x*cos + rotate_half(x)*sin, where rotate_half(x)*sin
        # equals x rolled by half times sin with its first half negated (`sin` arrives that way).
        qk = torch.cat((q, k), dim=1)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
        q, k = qk.split([self.num_heads, kvh], dim=1)
        if isinstance(plan, BatchPlan):
            return self._out(self._batched(q, k, v, k_cache, v_cache, plan), residual)
        if isinstance(plan, MixedPlan):
            outs, at = [], 0
            for part in plan.parts:
                n_part = part.b * part.q
                outs.append(self._batched(q[at:at + n_part], k[at:at + n_part], v[at:at + n_part],
                                          k_cache, v_cache, part))
                at += n_part
            return self._out(torch.cat(outs), residual)
        k, v = k.transpose(0, 1), v.transpose(0, 1)           # [kv_heads, n, d]
        if isinstance(plan.rows, slice):
            k_cache[:, plan.rows] = k
            v_cache[:, plan.rows] = v
        else:
            k_cache.index_copy_(1, plan.rows, k)
            v_cache.index_copy_(1, plan.rows, v)
        if plan.fresh:
            out = self._causal(q.transpose(0, 1), k, v)        # [heads, n, d]
            return self._out(out.transpose(0, 1).reshape(n, self.num_heads * d), residual)
        if plan.kernel == "triton":
            rows = plan.read if plan.read is not None else k_cache.shape[1]
            out = fused.tree_attention(q, k_cache[None], v_cache[None], plan.lengths, plan.tree, d ** -0.5, rows)
            return self._out(out.view(n, self.num_heads * d), residual)
        keys = k_cache if plan.read is None else k_cache[:, :plan.read]
        values = v_cache if plan.read is None else v_cache[:, :plan.read]
        # Fold: query row g*n+i is query i of head kv*g+g' -> [kv_heads, groups*n, d].
        qf = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
        if plan.kernel == "matmul":
            out = matmul_attention(qf, keys, values, d ** -0.5, None if plan.mask is None else plan.mask[0])
        else:
            out = F.scaled_dot_product_attention(qf[None], keys[None], values[None], attn_mask=plan.mask)[0]
        out = out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, self.num_heads * d)
        return self._out(out, residual)

    def _fused(self, qkv, cos, sin, k_cache, v_cache, plan, residual) -> torch.Tensor:
        """The triton static paths, single and batched: rope_write's one kernel, then the tree
        attention kernel over the rows it wrote."""
        d, heads, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else (None, None, 0.0)
        if isinstance(plan, MixedPlan):
            slots, rows = plan.slots, plan.rows
        elif isinstance(plan, BatchPlan):
            slots, rows = plan.slots.reshape(-1).contiguous(), plan.rows.reshape(-1).contiguous()
        else:
            slots, rows = None, plan.rows
        if isinstance(plan, BatchPlan) and plan.segments is not None:
            # Packed prompts: flash reads their keys and values beside the queries, not from the
            # pool, so the kernel hands them back too.
            qkv = rope_write(qkv, norms[0], norms[1], cos, sin, norms[2], k_cache, v_cache, slots, rows, heads, kvh,
                             True)
            q, k, v = qkv.split([heads, kvh, kvh], dim=1)
            return self._out(self._packed(q, k, v, plan), residual)
        q = rope_write(qkv, norms[0], norms[1], cos, sin, norms[2], k_cache, v_cache, slots, rows, heads, kvh)
        if isinstance(plan, (BatchPlan, MixedPlan)):
            outs, at = [], 0
            for part in plan.parts if isinstance(plan, MixedPlan) else (plan,):
                n_part = part.b * part.q
                outs.append(self._tree_kernel(q[at:at + n_part], k_cache, v_cache, part))
                at += n_part
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        else:
            read = plan.read if plan.read is not None else k_cache.shape[1]
            out = fused.tree_attention(q, k_cache[None], v_cache[None], plan.lengths, plan.tree, d ** -0.5, read)
        return self._out(out.view(qkv.shape[0], heads * d), residual)

    def _out(self, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.linear(out, self.o_proj.weight, self.o_proj.bias, None, residual)

    def _tree_kernel(self, q, k_cache, v_cache, plan: BatchPlan) -> torch.Tensor:
        """The triton kernel over this plan's slots (0..b-1, or plan.index): [b*q, heads, d]."""
        scale = self.head_dim ** -0.5
        if plan.index is not None:
            return fused.tree_attention(q, k_cache, v_cache, plan.lengths, plan.tree, scale, plan.read, plan.index)
        return fused.tree_attention(q, k_cache[:plan.b], v_cache[:plan.b], plan.lengths, plan.tree, scale, plan.read)

    def _batched(self, q, k, v, k_cache, v_cache, plan: BatchPlan) -> torch.Tensor:
        """q [b*q, heads, d], k/v [b*q, kv_heads, d]; caches [slots, kv_heads, rows, d] ->
        the attention output [b*q, heads*d], before o_proj."""
        b, n, d, kvh, g = plan.b, plan.q, self.head_dim, self.num_kv_heads, self.groups
        k_cache[plan.slots, :, plan.rows] = k.view(b, n, kvh, d)
        v_cache[plan.slots, :, plan.rows] = v.view(b, n, kvh, d)
        if plan.segments is not None:
            return self._packed(q, k, v, plan)
        if plan.read == 0:
            # Prompts into empty slots: each row attends among its own new rows, causally (no
            # mask, so the flash kernel stays eligible); padding after a prompt sees only itself
            # and what precedes it, and nobody reads it.
            qh = q.view(b, n, self.num_heads, d).transpose(1, 2)
            kh, vh = k.view(b, n, kvh, d).transpose(1, 2), v.view(b, n, kvh, d).transpose(1, 2)
            if g > 1 and not _SDPA_GQA:
                kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
            kwargs = {"enable_gqa": True} if g > 1 and _SDPA_GQA else {}
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **kwargs)
            return out.transpose(1, 2).reshape(b * n, self.num_heads * d)
        if plan.kernel == "triton":
            return self._tree_kernel(q, k_cache, v_cache, plan).view(b * n, self.num_heads * d)
        if plan.index is not None:  # a copy of the slot's rows: the kernels here take no slot index
            keys, values = k_cache.index_select(0, plan.index)[:, :, :plan.read], v_cache.index_select(0, plan.index)[:, :, :plan.read]
        else:
            keys, values = k_cache[:b, :, :plan.read], v_cache[:b, :, :plan.read]   # views: no copy
        # Fold per row as the single path does: query g*n+i of row r is query i of head kv*g+g'.
        qf = q.view(b, n, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * n, d)
        if plan.kernel == "matmul":
            scores = _scores(qf.reshape(b * kvh, g * n, d), keys.reshape(b * kvh, plan.read, d))
            scores = scores.view(b, kvh, g * n, plan.read).mul_(d ** -0.5).add_(plan.mask)
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            out = torch.bmm(probs.view(b * kvh, g * n, plan.read), values.reshape(b * kvh, plan.read, d))
            out = out.view(b, kvh, g * n, d)
        else:
            out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=plan.mask)
        return out.view(b, kvh, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, self.num_heads * d)

    def _packed(self, q, k, v, plan: BatchPlan) -> torch.Tensor:
        """Prompts packed into one row: each token attends causally within its own prompt."""
        n, d = plan.q, self.head_dim
        if plan.segment_lengths is None:
            # One kernel for every prompt, its bounds read on the device (flash's varlen form,
            # through its aten op): no padding and no launch per prompt.
            # Views do (the kernel wants only the last dimension contiguous): no copies.
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, plan.segments, plan.segments, n, n, 0.0, True, False, scale=d ** -0.5)[0]
            return out.reshape(n, self.num_heads * d)
        outs, at = [], 0
        *prompts, pad = plan.segment_lengths
        for count in prompts:
            if count:
                part = slice(at, at + count)
                outs.append(self._causal(q[part].transpose(0, 1), k[part].transpose(0, 1),
                                         v[part].transpose(0, 1)).transpose(0, 1))
            at += count
        outs.append(q.new_zeros((pad, self.num_heads, d)))  # nobody reads the padding's outputs
        return torch.cat(outs).reshape(n, self.num_heads * d)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # No mask, so the flash kernel (which handles GQA natively) is eligible on CUDA.
        if self.groups > 1 and not _SDPA_GQA:
            k = k.repeat_interleave(self.groups, dim=0)
            v = v.repeat_interleave(self.groups, dim=0)
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        kwargs = {"enable_gqa": True} if self.groups > 1 else {}
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, **kwargs)[0]


class MLP(nn.Module):
    linear = staticmethod(plain)  # DenseDecoder sets its Gemv (one-row products) here

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_name = cfg.hidden_act
        self.act = _ACTIVATIONS[cfg.hidden_act]

        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()

    def fuse(self) -> None:
        """One [gate; up] weight for one GEMM instead of two (the two become views of it)."""
        self.gate_up = _fuse_linears((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                norm: nn.Module | None = None) -> torch.Tensor:
        """x [n, H] -> the MLP's output, plus residual where given. norm: applied to x first.
        The norm rides on the gate/up product, the activation and the residual on the down
        product (the GEMV kernel folds them in for one row)."""
        if self.gate_up is not None:
            gate_up = self.linear(x, *self.gate_up, norm)
            return self.linear(gate_up, self.down_proj.weight, self.down_proj.bias, self.act_name, residual)
        if norm is not None:
            x = norm(x)
        out = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out if residual is None else residual + out


def _fuse_linears(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate Linear weights (and biases) along the output; rebind each to a view of it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, plan: AttentionPlan) -> torch.Tensor:
        x = self.self_attn(x, cos, sin, k_cache, v_cache, plan, norm=self.input_layernorm, residual=x)
        return self.mlp(x, residual=x, norm=self.post_attention_layernorm)


class Backbone(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def run_layer(layer: nn.Module, x, cos, sin, k_cache, v_cache, plan: AttentionPlan) -> torch.Tensor:
    """One decoder layer (a function of the layer, so one compiled graph serves every layer)."""
    return layer(x, cos, sin, k_cache, v_cache, plan)


class DenseDecoder(nn.Module):
    """A causal LM whose state_dict names are the Hugging Face checkpoint's."""

    def __init__(self, cfg: DecoderConfig, hf_config: Any = None) -> None:
        super().__init__()
        self.cfg = cfg
        # transformers-style attribute access to config.json fields, for code that reads model.config.
        self.config = hf_config
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.tie_weights()
        # A plain attribute, not a buffer: module.to(bfloat16) must not round the frequencies.
        self._inv_freq = rope_inv_freq(cfg)
        self.compiled_layer = None
        self.gemv = Gemv()
        for layer in self.model.layers:
            layer.self_attn.linear = layer.mlp.linear = self.gemv

    def use_kernels(self, on: bool) -> None:
        """Whether the static path may take the GEMV kernel (where its tune wins) and rope_write;
        off, it runs what torch.compile makes of the plain ops (benchmarks compare the two).
        Set before warm-up: compiled layers and graphs keep what they were traced with."""
        self.gemv.enabled = on
        for layer in self.model.layers:
            layer.self_attn.fused_writes = on

    def tune_gemv(self, rows: tuple[int, ...] = ()) -> None:
        """Measure the one-row products of the fused model (Gemv.tune), and the few-row ones at
        these row counts (Gemv.tune_rows: a verify's query buckets), before graphs or compiles,
        each with what DecoderLayer folds into it."""
        first = self.model.layers[0]
        layers = [(layer.self_attn, layer.mlp) for layer in self.model.layers]
        groups = [([a.qkv for a, _ in layers if a.qkv is not None], (first.input_layernorm, False)),
                  ([(a.o_proj.weight, a.o_proj.bias) for a, _ in layers], (None, True)),
                  ([m.gate_up for _, m in layers if m.gate_up is not None], (first.post_attention_layernorm, False)),
                  ([(m.down_proj.weight, m.down_proj.bias) for _, m in layers], (first.mlp.act_name, True)),
                  ([(self.lm_head.weight, self.lm_head.bias)], None)]
        groups = [(g, f) for g, f in groups if g]
        self.gemv.tune([g for g, _ in groups], folds=[f for _, f in groups])
        if any(m > 1 for m in rows):
            self.gemv.tune_rows([g for g, _ in groups], rows, folds=[f for _, f in groups])

    def compile_layers(self) -> None:
        """torch.compile one decoder layer's forward, shared by every layer (regional compilation:
        the layers run the same code on other weights, so it compiles once, not once per layer).
        Used by forwards that pass compiled=True (the static path that CUDA graphs capture)."""
        if self.compiled_layer is None:
            self.compiled_layer = torch.compile(run_layer, dynamic=None)

    def fuse(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections into single GEMMs (fewer launches per
        layer: a CUDA graph replay of a small-batch step is launch-bound). Idempotent."""
        for layer in self.model.layers:
            if layer.self_attn.qkv is None:
                layer.self_attn.fuse()
                layer.mlp.fuse()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [n] -> cos, sin [n, 1, d] in dtype (tables in float32, as transformers)."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[:, None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: AttentionPlan, feature_layers: tuple[int, ...] = (),
                compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids/positions [n]; caches [layers, kv_heads, rows, d] -> final normed hidden [n, H], features.

        features: concat of the hidden states output by feature_layers (0-based), [n, K*H], or None
        when feature_layers is empty. As transformers' hidden_states, the last layer's entry is
        the normed one.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # for the rolled RoPE form
        wanted = set(feature_layers)
        kept: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        run = self.compiled_layer if compiled and self.compiled_layer is not None else run_layer
        for i, layer in enumerate(self.model.layers):
            x = run(layer, x, cos, sin, k_cache[i], v_cache[i], plan)
            if i in wanted and i != last:
                kept[i] = x
        x = self.model.norm(x)
        if last in wanted:
            kept[last] = x
        feats = torch.cat([kept[i] for i in feature_layers], dim=-1) if feature_layers else None
        return x, feats


# ---- checkpoint I/O -----------------------------------------------------------------------------
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise ModelLoadError(f"no {CONFIG_NAME} in {directory}", "is this a Hugging Face model directory?")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _weight_files(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor name in the checkpoint -> (the safetensors file holding it, its shape)."""
    from safetensors import safe_open

    single = directory / WEIGHTS_NAME
    index = directory / INDEX_NAME
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in files if not p.is_file()]
        if absent:
            raise ModelLoadError(f"{index.name} names shards that are not there: {', '.join(absent)}")
    else:
        raise ModelLoadError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}",
                             "the fast backend reads safetensors checkpoints only")
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                found[name] = (path, tuple(f.get_slice(name).get_shape()))
    return found


def _mismatch(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
              optional: set[str]) -> list[str]:
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(f"{k} {found[k]} != {expected[k]}"
                   for k in set(expected) & set(found) if found[k] != expected[k])
    parts = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            parts.append(f"{label}: {shown}")
    return parts


def load_decoder(directory: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DenseDecoder:
    """Build a DenseDecoder from config.json + safetensors, checking every weight name and shape.

    No transformers and no remote code: the module is ours, so a checkpoint whose names or shapes
    differ from what its config implies is refused with the differences listed.
    """
    from safetensors import safe_open

    directory = Path(directory)
    raw = read_config(directory)
    cfg = DecoderConfig.from_dict(raw)
    # Old checkpoints carry RoPE tables; they are recomputed, never loaded.
    files = {k: v for k, v in _weight_files(directory).items() if not k.endswith("rotary_emb.inv_freq")}
    found = {k: shape for k, (_, shape) in files.items()}
    with torch.device("meta"):
        model = DenseDecoder(cfg, SimpleNamespace(**raw))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    parts = _mismatch(expected, found, tied)
    if parts:
        raise ModelLoadError(f"target weights in {directory} do not match its config: " + "; ".join(parts))
    state: dict[str, torch.Tensor] = {}
    for path in sorted({p for p, _ in files.values()}):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in expected and name not in tied:
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gave the two names separate Parameter objects
    model._inv_freq = model._inv_freq.to(device)
    return model.eval().requires_grad_(False)
