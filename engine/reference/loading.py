"""Finding and loading checkpoints: local directories or hub repo ids through the HF cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ddtree.engine.reference.errors import ModelLoadError

log = logging.getLogger(__name__)

_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja"]

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype, device: str, *, demo: bool = False) -> torch.dtype:
    """None or "auto" -> float32 on CPU, bfloat16 on CUDA, but float32 everywhere for the demo pair
    (`demo`); strings by name. The demo pair is tiny, so fp32 costs nothing there, and in fp32
    speculative output is token-identical to plain decoding, where bf16 can flip true near-ties."""
    if dtype is None or dtype == "auto":
        if demo:
            return torch.float32
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}", f"use one of {', '.join(sorted(DTYPES))}") from None


def is_demo_pair(directory: Path) -> bool:
    """Whether this target folder is the shipped demo pair's."""
    from ddtree.engine.demo import DemoMissing, demo_paths

    try:
        target, _ = demo_paths()
    except DemoMissing:
        return False
    try:
        directory = Path(directory)
        if directory.resolve() == target.resolve():
            return True
        # A copy elsewhere (a checkout beside an installed package, say): the same files.
        return ((directory / "config.json").read_bytes() == (target / "config.json").read_bytes()
                and (directory / "model.safetensors").stat().st_size
                == (target / "model.safetensors").stat().st_size)
    except OSError:
        return False


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub repo id, from the local cache first, then the hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelLoadError(f"model directory {text} not found", "pass a local directory or a hub repo id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, local_files_only=True, allow_patterns=_DOWNLOAD_PATTERNS))
    except (OSError, ValueError) as exc:  # the hub's cache misses and offline errors are OSErrors
        log.info("%s is not in the local HF cache (%s); downloading", text, type(exc).__name__)
    try:
        return Path(snapshot_download(text, allow_patterns=_DOWNLOAD_PATTERNS))
    except (OSError, ValueError) as exc:
        # The hub's messages run over several lines; the first names the cause.
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"cannot fetch {text} from the hub: {type(exc).__name__}: {first}",
                             "download it first (ddtree-console download) or pass a local directory") from None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def load_target_model(directory: Path, *, device: str, dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {directory}", "is this a Hugging Face model directory?")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the target from {directory}: {exc}") from None
    return model.to(device).eval()


def load_tokenizer(directory: Path):
    """The target's tokenizer, or None when the directory has none (token ids still work)."""
    from transformers import AutoTokenizer

    has_files = any((directory / name).is_file() for name in
                    ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
    if not has_files:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {directory}: {exc}") from None


def eos_token_ids(directory: Path, config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value) -> None:
        if value is None:
            return
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(read_json(directory / "generation_config.json").get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


def resolve_mask_token_id(drafter_dir: Path, tokenizer) -> int | None:
    """A drafter config may name its mask token as a string (SGLang's `mask_token`)."""
    raw = read_json(drafter_dir / "config.json")
    name = (raw.get("dflash_config") or {}).get("mask_token") or raw.get("mask_token") or "<|MASK|>"
    if tokenizer is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids(name)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", -1):
        return None
    return int(token_id)
