"""Every command we build parses with SGLang's own argument parser.

Needs a real SGLang install, which CI does not have: set DDTREE_SGLANG_PYTHONS to interpreters
(os.pathsep-separated) that can `import sglang.srt.server_args` (the wheel with its light
dependencies is enough; no GPU). The probe runs for real against them as well."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ddtree.engine.serving.launch import build_launch
from ddtree.engine.serving.probe import UnsupportedAlgorithmError, probe

PYTHONS = [p for p in os.environ.get("DDTREE_SGLANG_PYTHONS", "").split(os.pathsep) if p]
pytestmark = pytest.mark.skipif(not PYTHONS, reason="DDTREE_SGLANG_PYTHONS not set (needs a real SGLang)")

PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(sys.argv[1:])
keys = ("model_path", "tp_size", "tensor_parallel_size", "host", "port", "enable_metrics", "speculative_algorithm",
        "speculative_draft_model_path", "speculative_num_draft_tokens", "speculative_dflash_block_size",
        "speculative_draft_window_size", "speculative_dflash_draft_window_size", "attention_backend")
print(json.dumps({k: getattr(ns, k, None) for k in keys}))
"""


def parse(python: str, args: list[str]) -> dict:
    out = subprocess.run([python, "-c", PARSE, *args], capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("python", PYTHONS)
def test_built_commands_parse(python, tmp_path):
    caps = probe("sglang", python, cache_dir=tmp_path)
    table = {"kind": "sglang", "python": python, "model": "Qwen/Qwen3-8B", "draft_model": "z-lab/Qwen3-8B-DFlash-b16",
             "block_size": 16, "draft_window": 4096, "extra_args": ["--attention-backend", "fa3"]}
    for algorithm, tp, gpus in (("ar", 1, [3]), ("dflash", 2, [0, 1]), ("dflash", 8, list(range(8)))):
        spec = build_launch(table, algorithm=algorithm, budget=None, tp=tp, gpus=gpus, port=30123, caps=caps)
        assert spec.argv[1:3] == ("-m", "sglang.launch_server")
        ns = parse(python, list(spec.argv[3:]))
        assert ns["model_path"] == "Qwen/Qwen3-8B" and (ns["tp_size"] or ns["tensor_parallel_size"]) == tp
        assert ns["host"] == "127.0.0.1" and ns["port"] == 30123 and ns["enable_metrics"] is True
        assert ns["attention_backend"] == "fa3"
        if algorithm == "ar":
            assert ns["speculative_algorithm"] is None
        else:
            assert ns["speculative_algorithm"] == "DFLASH"
            assert ns["speculative_draft_model_path"] == "z-lab/Qwen3-8B-DFlash-b16"
            assert 16 in (ns["speculative_num_draft_tokens"], ns["speculative_dflash_block_size"])
            assert 4096 in (ns["speculative_draft_window_size"], ns["speculative_dflash_draft_window_size"])
    if "DDTREE" not in caps.algorithms:
        with pytest.raises(UnsupportedAlgorithmError):
            build_launch(table, algorithm="ddtree", budget=64, tp=1, gpus=[0], port=30123, caps=caps)


@pytest.mark.parametrize("python", PYTHONS)
def test_sweep_plan_commands_parse(python, tmp_path):
    """What `sweep --dry-run` prints for an sglang recipe is accepted by that SGLang's parser."""
    from ddtree.jobs.plan import make_plan
    from ddtree.jobs.recipe import recipe_from_dict

    recipe = recipe_from_dict({
        "name": "parse", "engine": {"kind": "sglang", "python": python, "model": "Qwen/Qwen3-8B",
                                    "draft_model": "z-lab/Qwen3-8B-DFlash-b16", "algorithm": "dflash",
                                    "block_size": 16, "draft_window": 4096, "gpus": list(range(8)),
                                    "extra_args": ["--attention-backend", "fa3"]},
        "sweep": {"tp": [1, 8], "baseline": ["ar"]}})
    plan = make_plan(recipe, cache_dir=tmp_path)
    assert len(plan.launches) == 4
    for launch in plan.launches:
        assert launch.unsupported is None, launch.unsupported
        argv = list(launch.argv)
        ns = parse(python, argv[argv.index("sglang.launch_server") + 1:])
        assert (ns["tp_size"] or ns["tensor_parallel_size"]) == launch.tp and ns["enable_metrics"] is True
        assert ns["speculative_algorithm"] == (None if launch.algorithm == "ar" else "DFLASH")
