"""The DFlash block drafter: config, module, checkpoint I/O.

The module reproduces the DFlash checkpoint layout (weight names, config keys, math) so that real
z-lab drafters load unchanged, without trust_remote_code:

- context features = concat of K target layers' hidden states, through `fc` then `hidden_norm`;
- in every layer, the features go through that layer's k_proj/k_norm/v_proj and sit before the
  block's own keys/values; queries come only from the block; no causal mask; RoPE on all keys;
- `norm` at the end; logits come from the target's lm_head (the drafter has no head of its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.engine.reference.errors import ModelLoadError
from ddtree.engine.reference.rope import scale_inv_freq

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Config keys we interpret; everything else in config.json is kept verbatim in `extra`.
_OWN_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "vocab_size", "block_size", "num_target_layers", "dflash_config", "attention_bias",
    "hidden_act", "rope_scaling", "rope_parameters", "initializer_range", "target_layer_ids", "mask_token_id",
}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to layer N-3, one per draft layer; one draft layer takes N//2."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int | None
    block_size: int = 16
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict | None = field(default=None, compare=False, hash=False)
    initializer_range: float = 0.02
    # Unknown config.json keys (architectures, auto_map, torch_dtype, ...), kept for round trips.
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "num_target_layers", "block_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"drafter config: {name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelLoadError("drafter config: hidden_size is not a multiple of num_attention_heads",
                                     "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("drafter config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ModelLoadError(f"drafter config: block_size must be at least 2, got {self.block_size}")
        ids = tuple(int(i) for i in self.target_layer_ids)
        object.__setattr__(self, "target_layer_ids", ids)
        if not ids:
            raise ModelLoadError("drafter config: target_layer_ids is empty")
        bad = [i for i in ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ModelLoadError(f"drafter config: target_layer_ids {bad} outside 0..{self.num_target_layers - 1}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ModelLoadError(f"drafter config: mask_token_id {self.mask_token_id} outside the vocabulary")
        if self.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(f"drafter config: unsupported hidden_act {self.hidden_act!r}",
                                 f"supported: {', '.join(sorted(_ACTIVATIONS))}")
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"drafter config: unsupported rope type {rope_type!r}",
                                 "supported: default, linear, llama3")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DFlashConfig:
        """Read a DFlash checkpoint's config.json (z-lab layout; SGLang's variants tolerated)."""
        if not isinstance(config, dict):
            raise ModelLoadError("drafter config must be a JSON object")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size")
        missing = [k for k in required if k not in config]
        if missing:
            raise ModelLoadError(f"drafter config lacks {', '.join(missing)}", "is this a DFlash drafter?")
        dflash = config.get("dflash_config") or {}
        num_layers = config["num_hidden_layers"]
        num_target_layers = config.get("num_target_layers")
        if num_target_layers is None:
            raise ModelLoadError("drafter config lacks num_target_layers", "is this a DFlash drafter?")
        layer_ids = _one_place(config, dflash, "target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        block_size = config.get("block_size", dflash.get("block_size", 16))
        rope_theta = config.get("rope_theta")
        rope_scaling = config.get("rope_scaling")
        params = config.get("rope_parameters")
        if isinstance(params, dict):
            if rope_theta is None:
                rope_theta = params.get("rope_theta")
            if rope_scaling is None and _rope_type(params) != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(layer_ids),
            mask_token_id=_one_place(config, dflash, "mask_token_id"),
            block_size=block_size,
            head_dim=config.get("head_dim"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 1_000_000.0),
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            attention_bias=bool(config.get("attention_bias", False)),
            hidden_act=config.get("hidden_act", "silu"),
            rope_scaling=rope_scaling,
            initializer_range=float(config.get("initializer_range", 0.02)),
            extra=_extra_keys(config, dflash),
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json of a DFlash checkpoint (loadable by z-lab's code and SGLang)."""
        out: dict[str, Any] = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}
        out.update(self.extra)
        dflash = dict(out.get("dflash_config") or {})
        dflash.update(target_layer_ids=list(self.target_layer_ids), block_size=self.block_size)
        if self.mask_token_id is not None:
            dflash["mask_token_id"] = self.mask_token_id
        for f in fields(self):
            if f.name in ("target_layer_ids", "mask_token_id", "extra"):
                continue
            out[f.name] = getattr(self, f.name)
        out["dflash_config"] = dflash
        return out

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)


def _one_place(config: dict, dflash: dict, key: str):
    """`key` from dflash_config or the top level (published DFlash configs use either); both set
    and different is a config that cannot be trusted, so it is refused."""
    nested, top = dflash.get(key), config.get(key)
    if nested is not None and top is not None and _as_list(nested) != _as_list(top):
        raise ModelLoadError(f"drafter config: dflash_config.{key} {nested!r} and top-level {key} {top!r} disagree",
                             "keep one of them")
    return nested if nested is not None else top


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _extra_keys(config: dict, dflash: dict) -> dict:
    extra = {k: v for k, v in config.items() if k not in _OWN_KEYS}
    # dflash_config keys we do not interpret (SGLang's mask_token string, ...) survive a round trip.
    rest = {k: v for k, v in dflash.items() if k not in ("target_layer_ids", "mask_token_id", "block_size")}
    if rest:
        extra["dflash_config"] = rest
    return extra


def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def rope_inv_freq(cfg: DFlashConfig) -> torch.Tensor:
    """Inverse frequencies (float32) for the config's RoPE variant."""
    dim = cfg.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / dim))
    inv_freq = scale_inv_freq(inv_freq, _rope_type(cfg.rope_scaling), cfg.rope_scaling)
    return inv_freq.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, as the Qwen3 reference does, so bf16 drafters match it.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, linear: Callable[[nn.Linear, torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        """linear(module, x) computes each projection (None: the module's own forward; the fast
        drafter passes its RowLinears)."""
        if linear is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return linear(self.down_proj, self.act(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class DraftCache:
    """Per-layer keys/values of the committed context only (block rows are never cached)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def get_seq_length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[-2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat((self.keys[layer], k), dim=-2)
            self.values[layer] = torch.cat((self.values[layer], v), dim=-2)
        return self.keys[layer], self.values[layer]

    def peek(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.keys[layer], self.values[layer]

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[..., :length, :]
                self.values[i] = self.values[i][..., :length, :]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: DraftCache | None) -> torch.Tensor:
        # x: [b, q, H] block rows (normed); ctx: [b, c, H] projected context features.
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat((ctx, x), dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # cos/sin: [b, 1, c+q, d]; the queries take the block's positions (the last q).
        q = q * cos[:, :, c_len:] + _rotate_half(q) * sin[:, :, c_len:]
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            old_k, old_v = cache.peek(self.layer_idx)
            cache.append(self.layer_idx, k[:, :, :c_len], v[:, :, :c_len])
            if old_k is not None:
                k = torch.cat((old_k, k), dim=2)
                v = torch.cat((old_v, v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, attention_mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """A DFlash drafter; weight names follow the z-lab checkpoint layout."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A plain attribute, not a buffer: module.to(bfloat16) must not round the frequencies.
        self._inv_freq = rope_inv_freq(cfg)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def new_cache(self) -> DraftCache:
        return DraftCache(self.config.num_hidden_layers)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def forward(self, noise_embeds: torch.Tensor, target_hidden: torch.Tensor,
                position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: DraftCache | None = None) -> torch.Tensor:
        """noise_embeds [b,q,H], target_hidden [b,c,K*H], position_ids [b,c+q] -> hidden [b,q,H].

        attention_mask: None (full attention) or an additive float mask [b,1,q,kv] where kv is the
        cached length plus c+q. With a cache, the c context rows are appended to it.
        """
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(noise_embeds.shape[0], -1)
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope(position_ids, noise_embeds.dtype)
        x = noise_embeds
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask, past_key_values)
        return self.norm(x)


def context_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """[b, n, K*H] from transformers' hidden_states tuple (entry 0 is the embeddings, so id+1)."""
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


def save_drafter(drafter: DFlashDrafter, directory: str | Path) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_dict()
    dtype = next(drafter.parameters()).dtype
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (directory / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    return directory


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = directory / WEIGHTS_NAME
    if single.is_file():
        return load_file(str(single))
    index = directory / INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(directory / shard)))
        return state
    raise ModelLoadError(f"no {WEIGHTS_NAME} in {directory}", "a DFlash drafter is config.json + safetensors")


def load_drafter(directory: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a drafter, checking every weight name and shape; mismatches are listed in the error."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise ModelLoadError(f"no {CONFIG_NAME} in {directory}", "pass a DFlash drafter directory")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from None
    cfg = DFlashConfig.from_dict(raw)
    state = _read_weights(directory)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(f"{k} {tuple(state[k].shape)} != {expected[k]}"
                   for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                parts.append(f"{label}: {shown}")
        raise ModelLoadError(f"drafter weights in {directory} do not match its config: " + "; ".join(parts))
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    drafter = drafter.to_empty(device=device)
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return drafter.to(device=device, dtype=dtype).eval()
