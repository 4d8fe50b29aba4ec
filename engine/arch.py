"""What a target's architecture lets the builtin engine do, read from its config alone (no torch).

The engine, the sweep plan, `serve` and the console's engine form all ask the same question before
anything starts: does this target have recurrent (linear-attention, Mamba, ...) layers? On such a
target the builtin engine decodes with ar only (see `speculative_refusal`). A config is either a
transformers config object or a plain config.json dict; multimodal wrappers keep the language
model's layout in `text_config`, which is read too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Layer types whose state is a set of KV rows (a tree mask can branch them, a crop can roll them back).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention"})
HYBRID_MODEL_TYPES = frozenset({
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "jamba", "bamba",
    "falcon_h1", "nemotron_h", "zamba", "zamba2", "granitemoehybrid", "lfm2", "mamba", "mamba2", "rwkv",
    "recurrent_gemma", "minimax",
})
# Keys only recurrent layers have (SGLang's hybrid check reads the same ones).
RECURRENT_KEYS = ("linear_num_value_heads", "mamba_d_state", "ssm_state_size")

SPECULATIVE_HINT = ("use algorithm ar, or serve it with SGLang "
                    "(DFLASH with --mamba-scheduler-strategy extra_buffer)")


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def hybrid_reason(config: Any) -> str | None:
    """Why this target is not pure attention (a short phrase), or None. `config`: a transformers
    config or a config.json dict."""
    if config is None:
        return None
    configs = [config]
    text_config = _get(config, "text_config")
    if text_config is not None and text_config is not config:
        configs.append(text_config)
    # The layer list names the recurrent layers, so it is the best answer wherever it sits.
    for cfg in configs:
        layer_types = _get(cfg, "layer_types") or _get(cfg, "layers_block_type")
        if isinstance(layer_types, (list, tuple)) and layer_types:
            odd = sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)
            if odd:
                return f"{_get(cfg, 'model_type') or 'target'} has recurrent layers ({', '.join(odd)})"
    for cfg in configs:
        model_type = str(_get(cfg, "model_type") or "")
        if _get(cfg, "hybrid_override_pattern"):
            return f"{model_type or 'target'} has a hybrid layer pattern"
        if model_type in HYBRID_MODEL_TYPES:
            return f"{model_type} is a hybrid/recurrent architecture"
        keys = [k for k in RECURRENT_KEYS if _get(cfg, k) is not None]
        if keys:
            return f"{model_type or 'target'} has recurrent layers ({keys[0]} is set)"
    return None


def is_speculative(algorithm: str, budget: int | None) -> bool:
    """Whether this request drafts: dflash always, ddtree unless its budget is 0 (then it is ar)."""
    return algorithm == "dflash" or (algorithm == "ddtree" and budget != 0)


def speculative_refusal(reason: str, algorithm: str) -> str:
    """The one line that refuses `algorithm` on a target with recurrent layers (`reason`)."""
    # Refusal, not repair: making the chain exact would need the recurrent state restored to the
    # accepted prefix after every verify (a state snapshot per node, or a second forward). Until
    # that is built and measured, the builtin engine never returns output that differs from
    # plain decoding, so it only runs ar on these targets.
    return (f"{reason}: the builtin engine refuses {algorithm} on it, since a recurrent state takes in "
            f"every verified node, rejected ones included, and only attention KV can be rolled back")


def builtin_refusal(config: Any, algorithm: str, budget: int | None = None) -> str | None:
    """The refusal line for running `algorithm` (at `budget`) on this target, or None if allowed."""
    if not is_speculative(algorithm, budget):
        return None
    reason = hybrid_reason(config)
    return None if reason is None else speculative_refusal(reason, algorithm)


def drafter_as_target(config: Any) -> str | None:
    """The refusal line when a target's config is a DFlash drafter's, else None. A drafter has no
    embedding or head of its own, so as a target it would load with those weights missing."""
    if config is None:
        return None
    architectures = _get(config, "architectures") or ()
    if _get(config, "dflash_config") is None and not any("DFlash" in str(a) for a in architectures):
        return None
    return "the model is a DFlash drafter, not a target: pass it as the drafter (--draft) and its target as --model"


def read_config(model: str | Path | None) -> dict | None:
    """A target's config.json as a dict, without network: a local directory, or a hub id already
    in the local Hugging Face cache. None when it cannot be read here (the engine checks again
    once it has loaded the model)."""
    if not model:
        return None
    path = Path(str(model)).expanduser()
    config_path = path / "config.json"
    if not config_path.is_file():
        text = str(model)
        if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
            return None
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        try:
            cached = try_to_load_from_cache(text, "config.json")
        except (ValueError, OSError):
            return None
        if not isinstance(cached, str):
            return None
        config_path = Path(cached)
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
