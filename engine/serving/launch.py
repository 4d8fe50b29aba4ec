"""How to start an engine server: one frozen LaunchSpec per (engine, algorithm, budget, tp, GPUs).

`build_launch(engine_table, algorithm=..., budget=..., tp=..., gpus=..., port=...)` turns the
recipe's [engine] table (a dict, or the recipe's EngineSpec dataclass) into the exact argv, the
environment overrides (CUDA_VISIBLE_DEVICES, the recipe's env), the health and metrics paths and
the address it will listen on, for kind "builtin", "sglang" or "vllm". SGLang and vLLM commands
are built from the capabilities of the recipe's interpreter (engine/serving/probe.py), so a flag the
installed build lacks is refused here, before anything is launched.

NUMA pinning (numa_bind = "auto", sglang/vllm only), given the GPUs' NUMA node and local CPUs:
`numactl --cpunodebind=N --membind=N` when numactl is installed; else `taskset -c CPUS` (CPUs
pinned, memory left to first-touch, which lands on the local node); else neither, and
`LaunchSpec.cpu_affinity` carries the CPUs for the runner to apply with os.sched_setaffinity.
`LaunchSpec.numa` says which of these happened.

The builtin server's command line is built here only (`builtin_argv`), for `build_launch`, the
sweep plan, the engine job and `ddtree-console serve`; its options are declared once too
(`add_builtin_options`), for the server's own parser and for `serve`'s.

Nothing here starts a process; the job runner spawns `argv` with `spawn_env()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ddtree.engine.serving import sglang as sglang_cmd
from ddtree.engine.serving import vllm as vllm_cmd
from ddtree.engine.serving.probe import (Capabilities, LaunchConfigError, ProbeError, UnsupportedAlgorithmError,
                                 UnsupportedFlagError, probe)

__all__ = ["KINDS", "ALGORITHMS", "BACKENDS", "BUILTIN_MODULE", "LaunchSpec", "build_launch", "builtin_argv",
           "add_builtin_options", "free_port", "LaunchConfigError", "UnsupportedAlgorithmError",
           "UnsupportedFlagError", "ProbeError"]

KINDS = ("builtin", "sglang", "vllm")
ALGORITHMS = ("ar", "dflash", "ddtree")
HOST = "127.0.0.1"
BUILTIN_MODULE = "ddtree.engine.reference.server"
#: The builtin server's --backend choices (engine/reference/backends.py holds the same three; named
#: here so that recipes, jobs and the console check them without importing torch).
BACKENDS = ("auto", "fast", "transformers")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LaunchSpec:
    """One engine server to start. `env` holds only the overrides; `spawn_env()` merges them."""

    kind: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    host: str = HOST
    port: int = 0  # 0: the builtin server picks one and announces it (announces_url)
    health_path: str = "/health"
    metrics_path: str | None = "/metrics"
    api: str = "generate"  # "generate" (SGLang-shaped /generate) or "openai" (vLLM)
    announces_url: bool = False  # prints {"event": "listening", "url": ...} on stdout when ready
    algorithm: str = "ar"
    budget: int | None = None
    tp: int = 1
    gpus: tuple[int, ...] = ()
    numa: str = "off"  # "numactl" | "taskset" | "runner" | "off" | "unknown"
    cpu_affinity: tuple[int, ...] = ()  # only with numa == "runner": apply before exec
    engine_version: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LaunchConfigError(f"unknown engine kind {self.kind!r}", "use one of: " + ", ".join(KINDS))
        if not self.argv or not all(isinstance(a, str) and a != "" for a in self.argv):
            raise LaunchConfigError("a launch needs a non-empty argv of non-empty strings")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise LaunchConfigError(f"port must be 0..65535, got {self.port!r}")
        if self.port == 0 and not self.announces_url:
            raise LaunchConfigError(f"{self.kind} needs a concrete port", "pass free_port()")
        env = dict(self.env)
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise LaunchConfigError(f"bad environment entry {key!r}={value!r}")
        object.__setattr__(self, "env", env)
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "gpus", tuple(self.gpus))

    @property
    def base_url(self) -> str | None:
        """Where it will listen; None until a builtin server on port 0 announces its port."""
        return f"http://{self.host}:{self.port}" if self.port else None

    @property
    def health_url(self) -> str | None:
        return self.base_url + self.health_path if self.base_url else None

    def spawn_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        return env

    def command_line(self) -> str:
        """What an operator would type: env overrides, then the shell-quoted argv."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(argv=list(self.argv), env=dict(self.env), gpus=list(self.gpus),
                    cpu_affinity=list(self.cpu_affinity), notes=list(self.notes),
                    base_url=self.base_url, command=self.command_line())
        return data


def free_port(host: str = HOST) -> int:
    """A port free right now on `host` (the engine binds it moments later; a lost race shows up
    as "port in use" in the engine log, which the runner retries with a new port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _as_dict(engine_table) -> dict:
    if dataclasses.is_dataclass(engine_table) and not isinstance(engine_table, type):
        data = {f.name: getattr(engine_table, f.name) for f in dataclasses.fields(engine_table)}
    elif isinstance(engine_table, Mapping):
        data = dict(engine_table)
    else:
        raise LaunchConfigError(f"the engine table must be a table, got {type(engine_table).__name__}")
    env = data.get("env") or {}
    if isinstance(env, (list, tuple)):  # EngineSpec keeps env as sorted (key, value) pairs
        env = dict(env)
    if not isinstance(env, Mapping):
        raise LaunchConfigError("engine.env must be a table of strings")
    data["env"] = {str(k): v for k, v in env.items()}
    extra = data.get("extra_args") or ()
    if isinstance(extra, str) or not all(isinstance(a, str) for a in extra):
        raise LaunchConfigError("engine.extra_args must be a list of strings", 'e.g. ["--attention-backend", "fa3"]')
    data["extra_args"] = tuple(extra)
    return data


def _check_common(kind: str, algorithm: str, budget, tp, gpus: Sequence[int]) -> None:
    if kind not in KINDS:
        raise LaunchConfigError(f"unknown engine kind {kind!r}", "use one of: " + ", ".join(KINDS))
    if algorithm not in ALGORITHMS:
        raise LaunchConfigError(f"unknown algorithm {algorithm!r}", "use one of: " + ", ".join(ALGORITHMS))
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise LaunchConfigError(f"tp must be a positive integer, got {tp!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise LaunchConfigError(f"budget must be an integer >= 0, got {budget!r}")
    if any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
        raise LaunchConfigError(f"gpus must be GPU indices, got {list(gpus)!r}")
    if len(set(gpus)) != len(gpus):
        raise LaunchConfigError(f"gpus lists a GPU twice: {list(gpus)}")
    if gpus and len(gpus) != tp:
        raise LaunchConfigError(f"tp {tp} needs {tp} GPUs, the launch got {len(gpus)}: {list(gpus)}",
                                "pass the tp GPUs this server uses (e.g. engine.gpus[:tp])")


def _numa_prefix(numa_bind, numa_node, numa_cpus, which: Callable[[str], str | None]
                 ) -> tuple[list[str], str, tuple[int, ...], list[str]]:
    """(argv prefix, how, cpu_affinity for the runner, notes)."""
    if numa_bind in (None, False, "off", "none", ""):
        return [], "off", (), []
    nodes: list[int] = []
    if numa_node is not None:
        nodes = [numa_node] if isinstance(numa_node, int) else [int(n) for n in numa_node]
    cpus = tuple(sorted(set(numa_cpus or ())))
    if not nodes and not cpus:
        return [], "unknown", (), ["numa_bind auto: the GPUs' NUMA node is unknown, so nothing is pinned"]
    if nodes and which("numactl"):
        spec = ",".join(str(n) for n in sorted(set(nodes)))
        return ["numactl", f"--cpunodebind={spec}", f"--membind={spec}"], "numactl", (), []
    if cpus and which("taskset"):
        from ddtree.engine.machine.hw import format_cpulist

        return (["taskset", "-c", format_cpulist(list(cpus))], "taskset", (),
                ["numactl not found: CPUs pinned with taskset, memory left to first-touch on the local node"])
    if cpus:
        return [], "runner", cpus, ["neither numactl nor taskset found: the runner sets the CPU affinity itself"]
    return [], "unknown", (), ["numactl not found and the GPUs' local CPUs are unknown: nothing is pinned"]


#: The builtin server's --max-running-requests when none is given.
DEFAULT_MAX_RUNNING = 8
#: The builtin server's DDTree node budget when --budget is not given (here, not in the engine, so that
#: `serve --help`, which must not import torch, can say it).
DEFAULT_BUDGET = 16


def builtin_argv(*, python: str | None = None, model: str | None = None, draft: str | None = None,
                 algorithm: str = "ddtree", budget: int | None = None, block_size: int | None = None,
                 device: str = "cpu", backend: str | None = "auto", host: str = HOST, port: int = 0,
                 dtype: str | None = None, max_running_requests: int | None = None,
                 max_queued_requests: int | None = None, threads: int | None = None,
                 batch: bool | None = None, context_window: int | None = None,
                 kv_pool_gb: float | None = None, engine_loop: str | None = None,
                 chunked_prefill_size: int | None = None, stream_interval: int | None = None,
                 enable_mixed_chunk: bool | None = False, max_prefill_tokens: int | None = None,
                 tokenizer_worker_num: int | None = None,
                 incremental_streaming_output: bool | None = False,
                 disable_overlap_schedule: bool | None = False) -> list[str]:
    """The builtin server's command line. Options left None are not passed (the server's default
    applies); model None is the server's demo pair."""
    argv = [python or sys.executable, "-m", BUILTIN_MODULE]
    if model:
        argv += ["--model", str(model)]
    if draft:
        argv += ["--draft", str(draft)]
    argv += ["--algorithm", algorithm]
    if budget is not None:
        argv += ["--budget", str(budget)]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    argv += ["--device", device, "--backend", backend or "auto", "--host", host, "--port", str(port)]
    for flag, value in (("--dtype", dtype), ("--max-running-requests", max_running_requests),
                        ("--max-queued-requests", max_queued_requests), ("--threads", threads),
                        ("--context-window", context_window), ("--kv-pool-gb", kv_pool_gb),
                        ("--engine-loop", engine_loop), ("--chunked-prefill-size", chunked_prefill_size),
                        ("--stream-interval", stream_interval), ("--max-prefill-tokens", max_prefill_tokens),
                        ("--tokenizer-worker-num", tokenizer_worker_num)):
        if value is not None:
            argv += [flag, str(value)]
    if batch is not None:
        argv.append("--batch" if batch else "--no-batch")
    if enable_mixed_chunk:
        argv.append("--enable-mixed-chunk")
    if incremental_streaming_output:
        argv.append("--incremental-streaming-output")
    if disable_overlap_schedule:
        argv.append("--disable-overlap-schedule")
    return argv


def _bounded(text: str, low: int, high: int | None = None, what: str = "") -> int:
    """An integer within [low, high] for argparse, else its one-line error."""
    if not re.fullmatch(r"\s*-?\d+\s*", text):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    value = int(text)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"{what} ({low}..{high})"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


#: The builtin server's --chunked-prefill-size.
DEFAULT_PREFILL_CHUNK = 2048
#: The builtin server's --max-prefill-tokens (SGLang's default).
DEFAULT_MAX_PREFILL_TOKENS = 16384


def prefill_chunk(text: str) -> int:
    """An argparse type: -1 (prefill whole) or a positive number of tokens."""
    value = _bounded(text, -1)
    if value == 0:
        raise argparse.ArgumentTypeError("must be -1 (prefill whole) or a positive number of tokens, got 0")
    return value


def non_negative(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _bounded(text, 0)


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _bounded(text, 1)


def model_ref(text: str) -> str:
    """An argparse type: a model directory or hub id, not empty (an empty one would quietly mean
    the demo pair)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a local directory or a hub repo id, got an empty string")
    return text


def device_name(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N, checked before the server starts, so a typo is one
    line and not torch's traceback from inside the server."""
    name, colon, index = text.partition(":")
    if name == "cpu" and not index or name == "cuda" and (not colon or index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r} (cpu, cuda or cuda:N)")


def positive_gb(text: str) -> float:
    """An argparse type: a size in GiB > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


#: HTTP processes the builtin server starts at most (--tokenizer-worker-num).
MAX_HTTP_WORKERS = 32


def _worker_count(text: str) -> int:
    """An argparse type: a count of HTTP processes, 1..MAX_HTTP_WORKERS."""
    return _bounded(text, 1, MAX_HTTP_WORKERS, "a count of HTTP processes")


def port_number(text: str) -> int:
    """An argparse type: a port, 0..65535."""
    return _bounded(text, 0, 65535, "a port number")


def add_builtin_options(parser: argparse.ArgumentParser, *, passthrough: bool, default_budget: int = DEFAULT_BUDGET
                        ) -> None:
    """The builtin server's options, declared once. The server's own parser (passthrough False)
    gets its defaults and checks the values itself after parsing; `ddtree-console serve`'s
    (passthrough True) checks each value as it parses it and leaves an option None unless it is
    given, so `builtin_argv` passes on only what the user asked for."""
    def default(value):
        return None if passthrough else value

    number = non_negative if passthrough else int
    parser.add_argument("--model", type=model_ref, help="target model: a local directory or a hub repo id (default: the demo pair)")
    parser.add_argument("--draft", type=model_ref, help="DFlash drafter: a local directory or a hub repo id (default: the demo "
                                        "drafter when --model is not given; none otherwise, which allows only ar)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="ddtree",
                        help="default algorithm; requests may override it (default: ddtree)")
    parser.add_argument("--budget", type=number, default=None,
                        help=f"default DDTree node budget (default: {default_budget}, capped by the engine's maximum)")
    parser.add_argument("--block-size", type=number, default=None, help="draft block size (default: the drafter's)")
    parser.add_argument("--device", type=device_name if passthrough else str, default="cpu",
                        help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default=default("auto"),
                        help="weights dtype (default: auto, float32 on a CPU and for the demo pair, else bfloat16)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (default): our fast forward with CUDA graphs for dense Qwen3/Qwen2/Llama/Mistral "
                             "on CUDA, transformers otherwise; fast or transformers force one (on a CPU, fast "
                             "preallocates every request slot's KV cache for the whole context window, and on "
                             "small models such as the demo pair it decodes faster; "
                             "bench/bench_demo.py --backends transformers,fast compares them)")
    parser.add_argument("--host", default=HOST, help=f"address to bind (default: {HOST})")
    parser.add_argument("--port", type=port_number if passthrough else int, default=0,
                        help="port (default: 0, a free port printed on stdout)")
    parser.add_argument("--max-running-requests", type=positive if passthrough else int, default=default(DEFAULT_MAX_RUNNING),
                        help=f"requests decoded at once, batched round by round (default: {DEFAULT_MAX_RUNNING}; "
                             "the fast backend holds a KV pool slot for each)")
    parser.add_argument("--max-queued-requests", type=number, default=default(64),
                        help="requests waiting beyond those; past this the server answers 503 (default: 64)")
    parser.add_argument("--threads", type=positive if passthrough else int, default=None,
                        help="torch CPU threads for the rounds (default on a CPU: one less than the usable CPUs, "
                             "at most torch's own choice (its physical cores), at least 1, so a round never waits "
                             "for the core the HTTP side or other work holds; on CUDA, or with OMP_NUM_THREADS "
                             "set, torch's choice)")
    parser.add_argument("--context-window", type=number, default=None,
                        help="tokens one request may hold, prompt and output (default: the model's; the fast "
                             "backend preallocates every slot's cache for it and caps the default at 8192)")
    parser.add_argument("--batch", action=argparse.BooleanOptionalAction, default=None,
                        help="verify (and draft) all running requests in one forward per round "
                             "(default: on; --no-batch steps them one by one)")
    parser.add_argument("--kv-pool-gb", type=positive_gb if passthrough else float, default=None,
                        help="fast backend: GiB for the KV pool that batched requests share; it runs at most as "
                             "many requests as it holds at the context window (default: room for "
                             "--max-running-requests)")
    parser.add_argument("--chunked-prefill-size", type=prefill_chunk if passthrough else int,
                        default=default(DEFAULT_PREFILL_CHUNK),
                        help=f"prompt tokens one prefill step takes at most: a longer prompt prefills a chunk a round, "
                             f"so running streams keep their inter-token latency; -1 prefills whole "
                             f"(default: {DEFAULT_PREFILL_CHUNK}, as SGLang's flag of that name)")
    parser.add_argument("--max-prefill-tokens", type=positive if passthrough else int,
                        default=default(DEFAULT_MAX_PREFILL_TOKENS),
                        help="prompt tokens the scheduler prefills in one turn at most: new requests past it wait a "
                             "turn (the first always goes), so a burst of joiners prefills over several turns and "
                             "no running stream waits for all of it at once; with --enable-mixed-chunk it bounds "
                             "the riders of a round too "
                             f"(default: {DEFAULT_MAX_PREFILL_TOKENS}, "
                             "as SGLang's flag of that name)")
    parser.add_argument("--enable-mixed-chunk", action="store_true", default=default(False),
                        help="fast backend with a KV pool: while requests run, joining prompts' prefills ride in "
                             "their round's forward, up to four a round, 128 to 512 tokens in all (at most "
                             "--chunked-prefill-size each), instead of a forward of their own that every running "
                             "stream waits for (a burst that riding would hold back more than twice as long still prefills "
                             "at once); lower inter-token latency under load, a later first token (as SGLang's flag "
                             "of that name)")
    parser.add_argument("--disable-overlap-schedule", action="store_true", default=default(False),
                        help="fast backend: queue no round on the KV pool, nor a lone greedy AR request's step, "
                             "before the host has read the one before it; by default the next one runs on the GPU "
                             "while the host books and streams the last (as SGLang's overlap scheduler, which its "
                             "flag of this name turns off)")
    parser.add_argument("--stream-interval", type=positive if passthrough else int, default=default(1),
                        help="tokens a running request gathers before they are sent: every update costs the HTTP "
                             "process a chunk, so at high token rates a larger value serves more tokens/s, in "
                             "coarser steps; the first token and the end are sent at once (default: 1, every "
                             "round; as SGLang's flag of that name)")
    parser.add_argument("--incremental-streaming-output", action="store_true", default=default(False),
                        help="/generate streams each chunk's new text and output_ids only, instead of all so far: "
                             "less to encode and send per chunk on long outputs; clients must join the pieces "
                             "(meta_info's counts stay totals; as SGLang's flag of that name)")
    parser.add_argument("--engine-loop", choices=("process", "thread"), default=default("process"),
                        help="where the rounds run: process (default), a process of their own beside the HTTP one, "
                             "as SGLang's scheduler; thread, on a thread of the HTTP process, sharing its GIL")
    parser.add_argument("--tokenizer-worker-num", type=_worker_count if passthrough else int, default=default(1),
                        metavar="N",
                        help="HTTP processes that share the port and the one engine process (--engine-loop process "
                             "only): each parses, tokenizes, detokenizes and streams its own connections, so a small "
                             "model's token rate is not capped by one process's CPU; the engine admits each request "
                             "(503 past its queue) before its response starts; each process costs CPU of its own "
                             f"(default: 1; as SGLang's flag of that name, 1..{MAX_HTTP_WORKERS})")


#: The builtin server's flags a recipe's own keys set (or the sweep, from its concurrency axis):
#: engine.extra_args may not set them, or the run would not be what the store says it is.
BUILTIN_MANAGED = ("--model", "--draft", "--algorithm", "--budget", "--block-size", "--device", "--backend",
                   "--host", "--port", "--max-running-requests")


class _NoExit(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise LaunchConfigError(message)


def check_builtin_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse, in one line, builtin engine.extra_args that set a managed flag or that the
    server's own options would not take (an unknown flag, a value out of range)."""
    for name in (a.split("=", 1)[0] for a in extra_args if a.startswith("--")):
        if name in BUILTIN_MANAGED:
            raise LaunchConfigError(f"engine.extra_args sets {name}, which the console manages",
                                    "take it out; the recipe's own keys and the sweep's concurrency set it")
    parser = _NoExit(prog="builtin", add_help=False)
    add_builtin_options(parser, passthrough=True)
    try:
        parser.parse_args(list(extra_args))
    except LaunchConfigError as exc:
        raise LaunchConfigError(f"engine.extra_args for the builtin engine: {exc.message}",
                                "see `ddtree-console serve --help` for its options") from None


def _builtin(table: dict, *, algorithm: str, budget, tp: int, gpus, port: int) -> tuple[list[str], dict, list[str]]:
    if tp != 1:
        raise LaunchConfigError(f"the builtin engine runs on one device, tp {tp} asked", "use tp = 1 for builtin")
    if table.get("numa_bind") not in (None, "off"):
        raise LaunchConfigError("engine.numa_bind applies to sglang and vllm only", "leave it out for builtin")
    device = table.get("device") or ("cuda" if gpus else "cpu")
    argv = builtin_argv(python=table.get("python"), model=table.get("model"), draft=table.get("draft_model"),
                        algorithm=algorithm, budget=budget, block_size=table.get("block_size"), device=device,
                        backend=table.get("backend"), port=port)
    extra = tuple(table.get("extra_args") or ())
    check_builtin_extra_args(extra)
    argv += extra
    env = {}
    if gpus and device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return argv, env, []


def build_launch(engine_table, *, algorithm: str, budget: int | None, tp: int, gpus: Sequence[int], port: int,
                 numa_cpus: Sequence[int] | None = None, numa_node: int | Sequence[int] | None = None,
                 caps: Capabilities | None = None, cache_dir: str | os.PathLike | None = None,
                 which: Callable[[str], str | None] = shutil.which) -> LaunchSpec:
    """The LaunchSpec for one server setting.

    engine_table: the recipe's [engine] table (dict or EngineSpec): kind, python, model,
        draft_model, block_size, device, backend (builtin only), numa_bind, extra_args, env.
    algorithm/budget/tp/gpus: this launch's server setting (gpus: exactly the tp GPUs it uses,
        or empty for CPU).
    port: a free port (free_port()); 0 only for the builtin engine, which then announces its own.
    numa_cpus/numa_node: the GPUs' local CPUs and NUMA node(s) (engine/machine/placement.py knows them).
    caps: the engine's capabilities; None probes the recipe's python (cached under cache_dir).
    """
    table = _as_dict(engine_table)
    kind = table.get("kind") or "builtin"
    gpus = tuple(gpus)
    _check_common(kind, algorithm, budget, tp, gpus)
    env_user = {}
    for key, value in table["env"].items():
        if not isinstance(value, str):
            raise LaunchConfigError(f"engine.env.{key} must be a string, got {value!r}")
        env_user[key] = value

    if kind == "builtin":
        argv, env, notes = _builtin(table, algorithm=algorithm, budget=budget, tp=tp, gpus=gpus, port=port)
        env = {**env_user, **env}
        return LaunchSpec(kind=kind, argv=tuple(argv), env=env, port=port, api="generate",
                          announces_url=True, algorithm=algorithm, budget=budget, tp=tp, gpus=gpus,
                          notes=tuple(notes))

    if table.get("backend") not in (None, "auto"):
        raise LaunchConfigError(f"engine.backend applies to the builtin engine only, not {kind}", "leave it out")
    if port == 0:
        raise LaunchConfigError(f"{kind} needs a concrete port", "pass free_port()")
    python = table.get("python") or sys.executable
    if caps is None:
        caps = probe(kind, python, cache_dir=cache_dir)
    elif caps.kind != kind:
        raise LaunchConfigError(f"capabilities of {caps.kind} given for a {kind} launch")
    builder = sglang_cmd.build_argv if kind == "sglang" else vllm_cmd.build_argv
    argv, notes = builder(table, algorithm=algorithm, budget=budget, tp=tp, port=port, caps=caps)
    prefix, how, affinity, numa_notes = _numa_prefix(table.get("numa_bind"), numa_node, numa_cpus, which)
    env = dict(env_user)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return LaunchSpec(kind=kind, argv=tuple(prefix + argv), env=env, port=port,
                      api="generate" if kind == "sglang" else "openai", announces_url=False,
                      metrics_path="/metrics", algorithm=algorithm, budget=budget if algorithm == "ddtree" else None,
                      tp=tp, gpus=gpus, numa=how, cpu_affinity=affinity, engine_version=caps.version,
                      notes=tuple(notes + numa_notes))
