"""Prompt sets for benchmarks.

A dataset name is one of:
- `builtin:NAME`: assets/prompts/NAME.jsonl shipped with the package (e.g. `builtin:code`, the
  held-out split of the demo pair's training text);
- a path to a local `.jsonl` file, one prompt per line;
- the name of a public benchmark (`humaneval`, `gsm8k`, `mt-bench`, `alpaca`, `sharegpt`, ...)
  whose `NAME.jsonl` is present in a dataset folder ($DDTREE_DATASETS, colon separated, else
  $XDG_DATA_HOME/ddtree-console/datasets). Nothing is downloaded.

Each line is a JSON object holding the prompt as text (`prompt`, `text`, `question`, `instruction`
(+ `input`), `turns[0]`, `conversations[0].value`) or as chat (`messages`: [{role, content}]).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from ddtree.engine.errors import EngineError


class DatasetError(EngineError):
    """A prompt set that cannot be found or read."""

    exit_code = 2


class DatasetNotFound(DatasetError):
    """A prompt file, or a named set in the dataset folders, that is not on this machine (it may be
    on the one that runs the sweep); a builtin set that is not shipped is a plain DatasetError."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: `text` always (chat flattened), `messages` when the source was chat, and the
    output tokens it asks for where it sets its own (None: the point's max_new_tokens)."""

    text: str
    messages: tuple[tuple[str, str], ...] | None = None
    max_new_tokens: int | None = None

    def chat(self) -> list[dict]:
        if self.messages is not None:
            return [{"role": role, "content": content} for role, content in self.messages]
        return [{"role": "user", "content": self.text}]


def builtin_dir() -> Path:
    import ddtree.assets

    return Path(ddtree.assets.__file__).resolve().parent / "prompts"


def dataset_dirs() -> list[Path]:
    env = os.environ.get("DDTREE_DATASETS")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return [Path(base) / "ddtree-console" / "datasets"]


def resolve_dataset(name: str) -> Path:
    """The file behind a dataset name; DatasetError naming what was tried when there is none."""
    if name.startswith("builtin:"):
        short = name.split(":", 1)[1]
        path = builtin_dir() / f"{short}.jsonl"
        if not path.is_file():
            have = sorted(p.stem for p in builtin_dir().glob("*.jsonl")) if builtin_dir().is_dir() else []
            raise DatasetError(f"no builtin prompt set {name!r}",
                               "available: " + (", ".join(f"builtin:{h}" for h in have) or "none shipped yet"))
        return path
    path = Path(name).expanduser()
    if path.suffix == ".jsonl" or os.sep in name:
        if not path.is_file():
            raise DatasetNotFound(f"prompt file not found: {path}")
        return path
    tried = [d / f"{name}.jsonl" for d in dataset_dirs()]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    raise DatasetNotFound(f"unknown dataset {name!r}",
                       "use builtin:code, a .jsonl path, or put " + " or ".join(str(t) for t in tried))


def _prompt_from_record(record: object) -> Prompt | None:
    if isinstance(record, str):
        return Prompt(record) if record.strip() else None
    if not isinstance(record, dict):
        return None
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        pairs = tuple((str(m.get("role", "user")), str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        if pairs:
            return Prompt("\n\n".join(c for _, c in pairs), messages=pairs)
    for key in ("prompt", "text", "question"):
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return Prompt(value)
    if isinstance(record.get("instruction"), str):
        extra = record.get("input")
        text = record["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        return Prompt(text)
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return Prompt(turns[0])
    conversations = record.get("conversations")
    if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
        value = conversations[0].get("value")
        if isinstance(value, str) and value.strip():
            return Prompt(value)
    return None


def read_prompts(path: Path) -> list[Prompt]:
    prompts = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{lineno} is not JSON: {exc.msg}") from None
                except ValueError:  # a number past Python's 4300-digit limit
                    raise DatasetError(f"{path}:{lineno} is not JSON: a number has too many digits") from None
                prompt = _prompt_from_record(record)
                if prompt is None:
                    raise DatasetError(f"{path}:{lineno} holds no prompt",
                                       'expected {"prompt": "..."} or {"messages": [...]}')
                prompts.append(prompt)
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    if not prompts:
        raise DatasetError(f"{path} holds no prompts")
    return prompts


def load_prompts(name: str, count: int, *, seed: int = 0, offset: int = 0) -> list[Prompt]:
    """`count` prompts from a dataset, in a seeded order, wrapping around a set smaller than that.

    The same (name, seed) gives the same order, so every point of a sweep sees the same prompts;
    `offset` picks a disjoint slice (warm-up requests use the prompts after the measured ones).
    """
    prompts = read_prompts(resolve_dataset(name))
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[order[(offset + i) % len(order)]] for i in range(count)]


def spread_output_lengths(prompts: list[Prompt], max_new_tokens: int, ratio: float, *,
                          seed: int = 0) -> list[Prompt]:
    """The prompts, each asking for an output length drawn uniformly from
    [max(1, int(max_new_tokens * ratio)), max_new_tokens], as sglang.bench_serving's
    --random-range-ratio draws its random dataset's (ratio 1: every prompt the full length, as
    given). With one length for all, a closed loop's requests finish in step, and every wave
    ends in a burst of joiners; spread lengths keep the joins apart, as real traffic does.
    The same seed gives the same lengths, so two sides of a comparison serve the same work."""
    if not 0.0 <= ratio <= 1.0:
        raise DatasetError(f"the output length ratio must be between 0 and 1, got {ratio}")
    if ratio == 1.0:
        return list(prompts)
    rng = random.Random(seed)
    low = max(1, int(max_new_tokens * ratio))
    return [Prompt(p.text, p.messages, rng.randint(low, max_new_tokens)) for p in prompts]
