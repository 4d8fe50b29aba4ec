"""Fixtures: a prompts file and a recipe writer for sweeps on the tiny random pair (the `tiny_pair`
and `server` fixtures are tests/conftest.py's). The demo pair is not needed (nor faster) for these."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(12)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_recipe(path: Path, tiny_pair, prompts_file: Path, **sweep) -> Path:
    """A builtin-engine recipe on the tiny pair; `sweep` overrides [sweep] keys."""
    target, drafter = tiny_pair
    table = {"budget": [2, 6], "concurrency": [1, 2], "dataset": str(prompts_file), "num_prompts": 4,
             "max_new_tokens": 8, "warmup": 1, "baseline": ["ar"], "timeout_s": 60.0, **sweep}

    def value(v):
        return json.dumps(v)

    lines = ['name = "tiny"', "[engine]", 'kind = "builtin"', f"model = {value(str(target))}",
             f"draft_model = {value(str(drafter))}", "ready_timeout_s = 120.0", "[sweep]"]
    lines += [f"{k} = {value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
