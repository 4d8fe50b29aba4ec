"""The engine job's spec is read through recipe.EngineSpec, the one engine schema: its one-line
errors, the job's own rules on top, and what a sweep's recipe still refuses."""

import pytest

from ddtree.jobs.kinds.engine import validate
from ddtree.jobs.recipe import RecipeError, recipe_from_dict


@pytest.fixture
def base(tmp_path):
    (tmp_path / "t").mkdir()
    return {"model": str(tmp_path / "t"), "algorithm": "ar"}


@pytest.mark.parametrize("extra, message", [
    ({"bogus": 1}, "unknown key 'engine.bogus'"),
    ({"numa_bind": "auto"}, "unknown key 'engine.numa_bind'"),  # a sweep's setting, not a job's
    ({"budget": 4}, "a node budget applies to algorithm ddtree only, not ar"),
    ({"algorithm": "ddtree", "budget": 4096}, "engine.budget must be <= 1024"),
    ({"device": "gpu0"}, "engine.device = 'gpu0' is not allowed"),
    ({"block_size": 1}, "engine.block_size must be >= 2"),
    ({"tp": 0}, "engine.tp must be an integer >= 1"),
    ({"ready_timeout_s": 10**6}, "engine.ready_timeout_s must be <= 86400"),
    ({"demo": "yes"}, "demo must be true or false"),
    ({"algorithm": "dflash"}, "algorithm dflash needs a drafter"),
    ({"kind": "vllm"}, "a vllm engine needs model and python"),
    ({"kind": "sglang", "python": "/no/such/python", "model": "m"}, "python interpreter not found or not executable"),
])
def test_bad_specs_are_refused_in_one_line(base, extra, message):
    with pytest.raises(RecipeError) as info:
        validate({**base, **extra})
    assert message in str(info.value) and "\n" not in str(info.value) and info.value.exit_code == 2


def test_a_spec_is_normalised(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = validate({**base, "model": " ./t ", "device": "cuda:1", "env": {"A": "1"}})
    assert spec["model"] == str(tmp_path / "t") and spec["device"] == "cuda:1"
    assert (spec["gpus"], spec["tp"], spec["env"], spec["extra_args"], spec["backend"]) == ([], 1, {"A": "1"}, [], "auto")
    assert validate(spec) == spec  # what the store holds reads back the same
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    sglang = validate({"kind": "sglang", "python": str(python), "model": "Qwen/Qwen3-8B", "algorithm": "ar"})
    assert (sglang["gpus"], sglang["tp"]) == ([0], 1)


def test_a_recipe_still_names_its_gpus_outside_the_device():
    with pytest.raises(RecipeError, match="engine.device = 'cuda:1' is not allowed"):
        recipe_from_dict({"name": "x", "engine": {"device": "cuda:1"}})
