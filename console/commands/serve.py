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

from ddtree.console.commands import UsageError
from ddtree.engine.arch import SPECULATIVE_HINT, builtin_refusal, drafter_as_target, read_config
from ddtree.engine.serving.launch import add_builtin_options, builtin_argv


class ServeError(UsageError):
    """The builtin engine cannot be served from this Python, or refuses this model and algorithm."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="run the builtin engine (SGLang-compatible HTTP API) in the foreground",
        description="Run the builtin DFlash/DDTree engine as an HTTP server speaking a subset of SGLang's API. "
                    "Prints one JSON line {\"event\": \"listening\", \"port\": N, \"url\": ...} on stdout once ready.")
    add_builtin_options(p, passthrough=True)
    p.set_defaults(command_module=__name__)


def server_argv(args: argparse.Namespace) -> list[str]:
    """The server's command line for these arguments (the options given, and the defaults said out loud)."""
    return builtin_argv(model=args.model, draft=args.draft, algorithm=args.algorithm, budget=args.budget,
                        block_size=args.block_size, device=args.device, backend=args.backend, host=args.host,
                        port=args.port, dtype=args.dtype, max_running_requests=args.max_running_requests,
                        max_queued_requests=args.max_queued_requests, threads=args.threads, batch=args.batch,
                        context_window=getattr(args, "context_window", None),
                        kv_pool_gb=getattr(args, "kv_pool_gb", None),
                        engine_loop=getattr(args, "engine_loop", None),
                        chunked_prefill_size=getattr(args, "chunked_prefill_size", None),
                        stream_interval=getattr(args, "stream_interval", None),
                        max_prefill_tokens=getattr(args, "max_prefill_tokens", None),
                        tokenizer_worker_num=getattr(args, "tokenizer_worker_num", None),
                        incremental_streaming_output=bool(getattr(args, "incremental_streaming_output", False)),
                        disable_overlap_schedule=bool(getattr(args, "disable_overlap_schedule", False)),
                        enable_mixed_chunk=bool(getattr(args, "enable_mixed_chunk", False)))


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
    misplaced = drafter_as_target(read_config(args.model))
    if misplaced is not None:
        raise ServeError(f"{args.model}: {misplaced}")
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
