"""SGLang's server command line, built only from flags the probed build accepts.

Per algorithm (ALGORITHMS.md, "In serving engines"):
- ar:     no speculative flags.
- dflash: --speculative-algorithm DFLASH --speculative-draft-model-path D
          [--speculative-num-draft-tokens B | --speculative-dflash-block-size B]
- ddtree: --speculative-algorithm DDTREE --speculative-draft-model-path D --speculative-ddtree-budget M
          [block size as above] [--page-size 1]; only a build that has DDTREE (open PR
          sgl-project/sglang#29907, or a plugin) gets it, the rest are refused.
Always: --model-path, the TP flag (--tp-size, --tensor-parallel-size in older releases), --host
127.0.0.1 --port N, --enable-metrics (Prometheus counters for per-run acceptance), then the
recipe's extra_args, each checked against the build's flags. Hybrid (Mamba/GDN) targets get
--mamba-scheduler-strategy extra_buffer, which DFLASH needs there.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree.engine.serving.probe import Capabilities, LaunchConfigError, UnsupportedAlgorithmError, UnsupportedFlagError

SERVER_MODULE = "sglang.launch_server"
DDTREE_HINT = ("use algorithm dflash, or point engine.python at a DDTree build "
               "(sgl-project/sglang PR #29907 adds --speculative-algorithm DDTREE)")

# Flags the console sets itself; extra_args may not override them (the run would not be what the
# store says it is).
MANAGED = ("--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--host", "--port",
           "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
           "--speculative-num-draft-tokens", "--speculative-dflash-block-size", "--speculative-ddtree-budget")


def flag_names(args: tuple[str, ...] | list[str]) -> list[str]:
    """The option names in an argument list (`--a=1` -> `--a`), values skipped."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_extra_args(extra_args: tuple[str, ...], caps: Capabilities, managed: tuple[str, ...]) -> None:
    for name in flag_names(extra_args):
        if name in managed:
            raise LaunchConfigError(f"engine.extra_args sets {name}, which the console manages",
                                    "take it out; the recipe's own keys (model, tp, algorithm, budget, "
                                    "block_size) set it")
        if caps.flags and name not in caps.flags:
            raise UnsupportedFlagError(f"engine.extra_args flag {name} is not accepted by {caps.label}",
                                       f"check `{caps.python} -m {SERVER_MODULE} --help`" if caps.kind == "sglang"
                                       else f"check `{caps.python} -m vllm.entrypoints.cli.main serve --help=all`")


def _need(caps: Capabilities, *names: str) -> str:
    flag = caps.first(*names)
    if flag is None:
        raise UnsupportedFlagError(f"{caps.label} accepts none of {', '.join(names)}",
                                   "point engine.python at a newer SGLang")
    return flag


def is_hybrid(model: str) -> bool:
    """A local target whose config declares linear-attention / Mamba layers (hub ids: unknown, False)."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    cfgs = [cfg] + [v for v in cfg.values() if isinstance(v, dict)]  # text_config of multimodal wrappers
    for c in cfgs:
        kinds = c.get("layer_types") or c.get("layers_block_type") or []
        if isinstance(kinds, list) and any(isinstance(k, str) and ("linear" in k or "mamba" in k) for k in kinds):
            return True
        if any(key in c for key in ("linear_num_value_heads", "mamba_d_state", "ssm_state_size")):
            return True
    return False


def build_argv(table: dict, *, algorithm: str, budget: int | None, tp: int, port: int,
               caps: Capabilities) -> tuple[list[str], list[str]]:
    """(argv, notes) for one SGLang server. `table` is the recipe's [engine] table as a dict."""
    model = table.get("model")
    if not model:
        raise LaunchConfigError("engine.model is required for kind sglang", "a local directory or a hub repo id")
    draft = table.get("draft_model")
    block = table.get("block_size")
    extra = tuple(table.get("extra_args") or ())
    notes: list[str] = []
    check_extra_args(extra, caps, MANAGED)

    argv = [caps.python, "-m", SERVER_MODULE, _need(caps, "--model-path", "--model"), str(model)]
    argv += [_need(caps, "--tp-size", "--tensor-parallel-size"), str(tp)]

    if algorithm in ("dflash", "ddtree"):
        name = algorithm.upper()
        if name not in caps.algorithms:
            if algorithm == "ddtree":
                raise UnsupportedAlgorithmError(f"this SGLang ({caps.version or 'unknown version'}) has no DDTREE",
                                                DDTREE_HINT)
            raise UnsupportedAlgorithmError(f"this SGLang ({caps.version or 'unknown version'}) has no DFLASH",
                                            "point engine.python at SGLang 0.5.11 or newer")
        if not draft:
            raise LaunchConfigError(f"algorithm {algorithm} needs engine.draft_model", "the DFlash drafter")
        argv += [_need(caps, "--speculative-algorithm"), name,
                 _need(caps, "--speculative-draft-model-path", "--speculative-draft-model"), str(draft)]
        if algorithm == "ddtree":
            if budget is None:
                raise LaunchConfigError("algorithm ddtree needs a budget", "set engine.budget or sweep.budget")
            if not caps.has("--speculative-ddtree-budget"):
                raise UnsupportedAlgorithmError(
                    f"this SGLang ({caps.version}) lists DDTREE but has no --speculative-ddtree-budget", DDTREE_HINT)
            argv += ["--speculative-ddtree-budget", str(budget)]
        if block is not None:
            argv += [_need(caps, "--speculative-num-draft-tokens", "--speculative-dflash-block-size"), str(block)]
        if algorithm == "ddtree" and caps.has("--page-size") and "--page-size" not in flag_names(extra):
            argv += ["--page-size", "1"]  # the DDTree worker refuses any other page size
        window = table.get("draft_window")
        if window is not None:
            argv += [_need(caps, "--speculative-draft-window-size", "--speculative-dflash-draft-window-size"),
                     str(window)]
        if is_hybrid(str(model)):
            if caps.has("--mamba-scheduler-strategy") and "--mamba-scheduler-strategy" not in flag_names(extra):
                argv += ["--mamba-scheduler-strategy", "extra_buffer"]
                notes.append("hybrid (Mamba/GDN) target: added --mamba-scheduler-strategy extra_buffer")
            if algorithm == "ddtree":
                notes.append("hybrid target: sibling branches share recurrent state, so DDTree acceptance "
                             "collapses as the budget grows")
    elif algorithm != "ar":
        raise LaunchConfigError(f"unknown algorithm {algorithm!r}", "use ar, dflash or ddtree")
    elif budget is not None:
        notes.append(f"budget {budget} ignored: algorithm ar drafts nothing")

    argv += [_need(caps, "--host"), "127.0.0.1", _need(caps, "--port"), str(port)]
    if caps.has("--enable-metrics"):
        argv.append("--enable-metrics")
    else:
        notes.append(f"{caps.label} has no --enable-metrics: per-run acceptance from per-request meta_info only")
    argv += list(extra)
    return argv, notes
