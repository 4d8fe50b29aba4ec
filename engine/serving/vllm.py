"""vLLM's OpenAI server command line (`vllm serve`, run through the recipe's interpreter).

- ar:     no speculative config.
- dflash: --speculative-config '{"method": "dflash", "model": D, "num_speculative_tokens": B-1}'
          (B = the drafter's block size: one bonus position plus B-1 drafted ones; left out when
          the block size is unknown so vLLM reads it from the drafter's config).
- ddtree: refused; no vLLM release has it (open PR vllm-project/vllm#42910).
vLLM exports its spec-decode counters on /metrics by default; it has no SGLang /generate, so the
bench client must use the OpenAI endpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree.engine.serving.probe import Capabilities, LaunchConfigError, UnsupportedAlgorithmError
from ddtree.engine.serving.sglang import check_extra_args

CLI_MODULE = "vllm.entrypoints.cli.main"
MANAGED = ("--model", "--tensor-parallel-size", "-tp", "--host", "--port", "--speculative-config", "-sc")


def _draft_block_size(draft: str) -> int | None:
    try:
        cfg = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size")
    return value if isinstance(value, int) and value > 1 else None


def build_argv(table: dict, *, algorithm: str, budget: int | None, tp: int, port: int,
               caps: Capabilities) -> tuple[list[str], list[str]]:
    model = table.get("model")
    if not model:
        raise LaunchConfigError("engine.model is required for kind vllm", "a local directory or a hub repo id")
    extra = tuple(table.get("extra_args") or ())
    notes: list[str] = []
    if algorithm == "ddtree":
        raise UnsupportedAlgorithmError(f"vLLM ({caps.version or 'unknown version'}) has no DDTree",
                                        "use algorithm dflash, or kind sglang with a DDTree build")
    check_extra_args(extra, caps, MANAGED)
    if caps.flags and "--speculative-config" not in caps.flags and algorithm != "ar":
        raise UnsupportedAlgorithmError(f"{caps.label} has no --speculative-config", "upgrade vLLM")
    argv = [caps.python, "-m", CLI_MODULE, "serve", str(model), "--tensor-parallel-size", str(tp),
            "--host", "127.0.0.1", "--port", str(port)]
    if algorithm == "dflash":
        if caps.algorithms and "dflash" not in caps.algorithms:
            raise UnsupportedAlgorithmError(f"this vLLM ({caps.version}) has no dflash speculative method",
                                            "upgrade vLLM, or use kind sglang")
        draft = table.get("draft_model")
        if not draft:
            raise LaunchConfigError("algorithm dflash needs engine.draft_model", "the DFlash drafter")
        config: dict = {"method": "dflash", "model": str(draft)}
        block = table.get("block_size") or _draft_block_size(str(draft))
        if block is not None:
            config["num_speculative_tokens"] = int(block) - 1
        else:
            notes.append("block size unknown: vLLM reads num_speculative_tokens from the drafter's config")
        argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    elif algorithm != "ar":
        raise LaunchConfigError(f"unknown algorithm {algorithm!r}", "use ar, dflash or ddtree")
    if budget is not None:
        notes.append(f"budget {budget} ignored: vLLM's dflash drafts a chain")
    argv += list(extra)
    return argv, notes
