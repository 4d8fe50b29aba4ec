"""`ddtree-console serve`: the builtin engine's HTTP server in the foreground.

The console never imports the engine (torch lives only in ddtree.engine.reference), so this command
replaces itself with `python -m ddtree.engine.reference.server ...` via exec: same pid, same
terminal, signals (Ctrl-C, SIGTERM) go straight to the server, and its exit code is ours.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from ddtree.engine.arch import SPECULATIVE_HINT, builtin_refusal, read_config
from ddtree.engine.errors import EngineError

SERVER_MODULE = "ddtree.engine.reference.server"
#: The builtin engine's backends (engine/reference/backends.py; named here so serve imports no torch).
BACKENDS = ("auto", "fast", "transformers")


class ServeError(EngineError):
    exit_code = 2


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _device(text: str) -> str:
    """cpu, cuda or cuda:N: checked here, so a typo is one line and not torch's traceback from
    inside the server after it started."""
    name, _, index = text.partition(":")
    if name == "cpu" and not index or name == "cuda" and (not _ or index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r} (cpu, cuda or cuda:N)")


def _port(text: str) -> int:
    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0..65535), got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="run the builtin engine (SGLang-compatible HTTP API) in the foreground",
        description="Run the builtin DFlash/DDTree engine as an HTTP server speaking a subset of SGLang's API. "
                    "Prints one JSON line {\"event\": \"listening\", \"port\": N, \"url\": ...} on stdout once ready.")
    p.add_argument("--model", help="target model: a local directory or a hub repo id (default: the demo pair)")
    p.add_argument("--draft", help="DFlash drafter: a local directory or a hub repo id (default: the demo drafter)")
    p.add_argument("--algorithm", choices=("ar", "dflash", "ddtree"), default="ddtree",
                   help="default algorithm; requests may override it (default: ddtree)")
    p.add_argument("--budget", type=_non_negative, help="default DDTree node budget")
    p.add_argument("--block-size", type=_non_negative, help="draft block size (default: the drafter's)")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights dtype (default: auto, float32 on a CPU and for the demo pair, else bfloat16)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto (default): our fast forward with CUDA graphs for dense Qwen3/Qwen2/Llama/Mistral "
                        "on CUDA, transformers otherwise; fast or transformers force one")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=0, help="port (default: 0, a free port printed on stdout)")
    p.add_argument("--max-running-requests", type=int, help="requests decoded at once (default: 8)")
    p.add_argument("--max-queued-requests", type=int, help="queued beyond those before 503 (default: 64)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--batch", action=argparse.BooleanOptionalAction, default=None,
                   help="verify all running requests in one forward per round (default: on)")
    p.set_defaults(command_module=__name__)


def server_argv(args: argparse.Namespace) -> list[str]:
    """The server's command line for these arguments (also what a job would spawn)."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--algorithm", args.algorithm, "--device", args.device,
            "--backend", getattr(args, "backend", None) or "auto", "--host", args.host, "--port", str(args.port)]
    batch = getattr(args, "batch", None)
    if batch is not None:
        argv.append("--batch" if batch else "--no-batch")
    for flag, value in (("--model", args.model), ("--draft", args.draft), ("--budget", args.budget),
                        ("--dtype", getattr(args, "dtype", None)),
                        ("--block-size", args.block_size),
                        ("--max-running-requests", getattr(args, "max_running_requests", None)),
                        ("--max-queued-requests", getattr(args, "max_queued_requests", None)),
                        ("--threads", getattr(args, "threads", None))):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def refusal(args: argparse.Namespace) -> str | None:
    """Why the server would refuse this default algorithm on this target, before it loads anything
    (a target with recurrent layers decodes with ar only). A target without a drafter is served as
    ar, so it passes; so does one whose config cannot be read here (the server checks it again)."""
    if args.model is None or args.draft is None:
        return None  # the demo pair is pure attention
    return builtin_refusal(read_config(args.model), args.algorithm, args.budget)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("uvicorn") is None:
        raise ServeError("the builtin engine is not installed in this Python",
                         hint="pip install 'ddtree-console[engine]'")
    why = refusal(args)
    if why is not None:
        raise ServeError(why, hint=SPECULATIVE_HINT)
    argv = server_argv(args)
    # No weight-loading bar: on the terminal it printed before (and garbled) the one `error:` line
    # of a failure after the load. Set HF_HUB_DISABLE_PROGRESS_BARS=0 to have it back.
    env = dict(os.environ)
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached: exec replaced this process
