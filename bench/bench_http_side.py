"""The builtin server's HTTP-side CPU per streamed token, side by side across server variants.

The builtin server (`python -m ddtree.engine.reference.server`) is two processes by default
(--engine-loop process): the HTTP process parses each request, tokenizes it, detokenizes every
update and writes one SSE chunk per update, and a child engine process runs the decoding rounds.
At high token rates the HTTP process's CPU per token caps the server's throughput, so that is what
this script measures, directly: CPU time (user + system, from psutil) of the HTTP process, of its
children (the engine) and of this process (the client) around one sweep point, divided by the
output tokens of that point. CPU time, not wall time, so that a loaded box moves it less.

Method:
1. Builds the tests' tiny random pair (context window 512 tokens) unless --model/--draft are given,
   and loads --num-prompts builtin:code prompts cut to --prompt-chars characters each, so that
   prompt + --max-new-tokens fit that window.
2. Starts one server per variant, one after the other: "default" (the common flags only), each
   --variant LABEL=ARGS (the common flags followed by ARGS, so ARGS may override them), and with
   --baseline REV the default server run from a git worktree of REV (the code before a change,
   imported ahead of the editable install through PYTHONPATH), and with --without M1,M2 the default
   server with those modules made unimportable. Common flags: --port 0 --threads 1
   --batch --max-running-requests C --max-queued-requests 4C --algorithm A, with OMP_NUM_THREADS=1.
3. Warms each server with one point of 2 prompts, unmeasured.
4. --repeats times, for each variant in order (A B A B ...; only one server works at a time): one
   point through the sweep client (engine/serving/bench.py's run_point) with CPU times read just
   before and after it.
5. Prints one row per variant: median tok/s, median HTTP us/token (min-max over repeats; summed
   over the HTTP processes where --tokenizer-worker-num starts several), the busiest HTTP
   process's us/token (what caps the rate), engine
   and client us/token, and the ratio of the median HTTP us/token to the first variant's (default).

    .venv/bin/python bench/bench_http_side.py [--model DIR --draft DIR] [--concurrency 32]
        [--algorithm ar] [--budget 8] [--max-new-tokens 64] [--num-prompts N] [--repeats 3]
        [--prompt-chars 300] [--variant LABEL=ARGS ...] [--without MODULES] [--baseline REV]
        [--out FILE.json] [--py-spy STEM]
        [--keep-logs DIR]

For example, the default server against the single-process one and against the previous commit:
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_http_side.py \\
        --variant "thread=--engine-loop thread" --baseline HEAD~1 --out http-side.json

With --engine-loop thread the engine runs inside the HTTP process, so that variant's HTTP figure
includes the engine's work and its engine figure is 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support: the tests' tiny pair and server process

from bench_server import server_flags  # noqa: E402  (this folder is sys.path[0])
from py_spy import sampled  # noqa: E402

#: What every server runs with: one thread each, so the 2 processes of a server do not fight
#: over a small box's cores, and no tokenizer thread pool in the HTTP process.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

#: The folders that install as ddtree.<name> (pyproject.toml's package-dir).
PACKAGE_FOLDERS = ("engine", "console", "jobs", "store", "assets")

DEFAULT_LABEL = "default"


@dataclass(frozen=True)
class Variant:
    """One server to measure: `extra` follows the common flags; `env` is added to SERVER_ENV;
    `rev` names the revision when the server runs code other than this tree's."""

    label: str
    extra: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    rev: str | None = None

    def __post_init__(self) -> None:
        if not self.label or any(ch.isspace() for ch in self.label):
            raise ValueError(f"a variant label must be a word, got {self.label!r}")


def parse_variant(text: str) -> Variant:
    """`LABEL=ARGS` -> Variant(LABEL, shlex.split(ARGS)); argparse shows the ArgumentTypeError's
    message as its one-line error."""
    label, sep, args = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"takes LABEL=ARGS, got {text!r}")
    label = label.strip()
    if label == DEFAULT_LABEL:
        raise argparse.ArgumentTypeError(f"the label {DEFAULT_LABEL!r} is the default server's")
    try:
        return Variant(label, tuple(shlex.split(args)))
    except ValueError as exc:  # an unclosed quote, or a label that is not a word
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def baseline_tree(rev: str, stack: ExitStack) -> Variant:
    """A detached worktree of `rev` plus a folder holding ddtree/<name> links into it; the server
    started with PYTHONPATH=<that folder> imports the worktree's code ahead of the editable
    install. Both are removed when `stack` closes."""
    short = git("rev-parse", "--short", f"{rev}^{{commit}}")
    tree = Path(tempfile.gettempdir()) / f"bench-http-{short}"
    pkg = Path(tempfile.gettempdir()) / f"bench-http-{short}-pkg"
    if tree.exists():  # left by an earlier run that was killed before its cleanup
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tree, ignore_errors=True)
        git("worktree", "prune")
    git("worktree", "add", "--quiet", "--detach", str(tree), short)
    stack.callback(lambda: subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                                          capture_output=True))
    shutil.rmtree(pkg, ignore_errors=True)
    (pkg / "ddtree").mkdir(parents=True)
    stack.callback(shutil.rmtree, pkg, True)
    for name in PACKAGE_FOLDERS:
        if (tree / name).is_dir():
            (pkg / "ddtree" / name).symlink_to(tree / name, target_is_directory=True)
    pythonpath = os.pathsep.join(p for p in (str(pkg), os.environ.get("PYTHONPATH", "")) if p)
    # A baseline that quietly ran this tree's code would read as "no change": check where it imports from.
    probe = "import importlib.util as u; print(u.find_spec('ddtree.engine.reference.server').origin)"
    origin = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, **SERVER_ENV, "PYTHONPATH": pythonpath}).stdout.strip()
    if not origin.startswith(str(pkg)):
        raise RuntimeError(f"the baseline server would import from {origin or '?'}, not from {pkg}")
    return Variant(f"baseline@{short}", env={"PYTHONPATH": pythonpath}, rev=git("rev-parse", short))


def without_modules(names: list[str], stack: ExitStack) -> Variant:
    """The default server with `names` unimportable: a folder of stubs that raise ImportError, ahead
    on PYTHONPATH (uvicorn then falls back from uvloop to asyncio and from httptools to h11)."""
    stubs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-http-without-")))
    for name in names:
        (stubs / f"{name}.py").write_text(f"raise ImportError('{name} is left out by bench_http_side --without')\n")
    pythonpath = os.pathsep.join(p for p in (str(stubs), os.environ.get("PYTHONPATH", "")) if p)
    return Variant("without-" + "-".join(names), env={"PYTHONPATH": pythonpath})


def cpu_s(procs) -> float:
    """User + system CPU seconds of `procs`, summed."""
    total = 0.0
    for proc in procs:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


class Server:
    """One variant's running server, with the psutil handles its CPU is read from."""

    def __init__(self, variant: Variant, common: list[str], log_dir: Path) -> None:
        import psutil

        from ddtree.engine.serving.bench import wait_ready
        from tests.support.server import SERVER, ServerProcess

        self.variant = variant
        self.argv = [*SERVER, *common, *variant.extra]
        self.log_path = log_dir / f"server-{variant.label}.log"
        try:
            self.proc = ServerProcess(self.argv, self.log_path, timeout_s=300, env={**SERVER_ENV, **variant.env})
        except RuntimeError:  # its message holds the log's whole tail (a usage text, a traceback): keep one line
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
            raise RuntimeError(f"the {variant.label} server did not start: {lines[-1] if lines else 'no log'} "
                               f"(log {self.log_path}; --keep-logs DIR keeps it)") from None
        self.url = self.proc.url
        wait_ready(self.url, timeout_s=120)
        self.main = psutil.Process(self.proc.proc.pid)
        self.http: list = [self.main]
        self.children: list = []

    def find_children(self) -> None:
        """The HTTP processes (the server and its --tokenizer-worker-num workers) and the engine
        process (none with --engine-loop thread); read once the server has served, so that a
        child started lazily is there."""
        children = self.main.children(recursive=True)
        workers = [p for p in children if "--http-worker-of" in p.cmdline()]
        self.http = [self.main, *workers]
        self.children = [p for p in children if p not in workers]

    def stop(self) -> None:
        self.proc.stop(60)


def measure(server: Server, prompts, cfg) -> dict:
    """One point with the CPU of the HTTP process, its children and this client around it."""
    import psutil

    from ddtree.engine.serving.bench import run_point

    me = psutil.Process()
    # run_point collects the heap before a point; done here first, that collection (0.2 s with
    # torch imported) stays out of the client's CPU figure, and run_point's own walks only what is new.
    gc.collect()
    gc.freeze()
    each0 = [cpu_s([p]) for p in server.http]
    h0, e0, c0 = sum(each0), cpu_s(server.children), cpu_s([me])
    t0 = time.perf_counter()
    result = run_point(server.url, prompts, cfg)
    wall = time.perf_counter() - t0
    each1 = [cpu_s([p]) for p in server.http]
    h1, e1, c1 = sum(each1), cpu_s(server.children), cpu_s([me])
    gc.unfreeze()  # frozen at exit, nanobind's objects read as leaks
    tokens = result.metrics["output_tokens"] or 0
    failed = [r for r in result.requests if not r.ok]

    def per_token(seconds: float) -> float | None:
        return round(seconds / tokens * 1e6, 1) if tokens else None

    return {"variant": server.variant.label, "tok_s": result.metrics["output_tok_s"], "tokens": tokens,
            "wall_s": round(wall, 3), "http_us": per_token(h1 - h0), "engine_us": per_token(e1 - e0),
            # The busiest HTTP process's share: with several (--tokenizer-worker-num), what caps the rate.
            "busiest_http_us": per_token(max(b - a for a, b in zip(each0, each1))),
            "client_us": per_token(c1 - c0), "requests": len(result.requests), "failed": len(failed),
            "failures": [f"{r.error}: {r.detail}" for r in failed[:5]]}


def report_failures(point: dict) -> None:
    if point["failed"]:
        print(f"  {point['variant']}: {point['failed']} of {point['requests']} requests failed, e.g.", flush=True)
        for line in point["failures"]:
            print(f"    {line[:300]}", flush=True)


def summarize(labels: list[str], points: list[dict]) -> list[dict]:
    """One row per variant: medians over its points, HTTP spread, and HTTP / the first variant's."""
    rows = []
    for label in labels:
        mine = [p for p in points if p["variant"] == label]
        http = [p["http_us"] for p in mine if p["http_us"] is not None]

        def med(key: str) -> float | None:
            values = [p[key] for p in mine if p[key] is not None]
            return statistics.median(values) if values else None

        rows.append({"variant": label, "points": len(mine), "tok_s": med("tok_s"), "http_us": med("http_us"),
                     "http_us_min": min(http, default=None), "http_us_max": max(http, default=None),
                     "busiest_http_us": med("busiest_http_us"),
                     "engine_us": med("engine_us"), "client_us": med("client_us"),
                     "failed": sum(p["failed"] for p in mine)})
    first = rows[0]["http_us"] if rows else None
    for row in rows:
        row["http_ratio"] = round(row["http_us"] / first, 3) if first and row["http_us"] is not None else None
    return rows


def fmt(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows: list[dict]) -> None:
    width = max(len("variant"), *(len(r["variant"]) for r in rows))
    print(f"{'variant':<{width}}  {'tok/s':>7}  {'http us/tok (min-max)':>22}  {'busiest http':>12}  "
          f"{'engine us/tok':>13}  {'client us/tok':>13}  {'http / ' + rows[0]['variant']:>16}  failed")
    for r in rows:
        spread = f"{fmt(r['http_us'])} ({fmt(r['http_us_min'])}-{fmt(r['http_us_max'])})"
        print(f"{r['variant']:<{width}}  {fmt(r['tok_s']):>7}  {spread:>22}  {fmt(r.get('busiest_http_us')):>12}  "
              f"{fmt(r['engine_us']):>13}  {fmt(r['client_us']):>13}  {fmt(r['http_ratio'], 3):>16}  {r['failed']}")


def machine() -> dict:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": model,
            "cpu_count": os.cpu_count(), "cpus_usable": usable}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target model folder (default: the tests' tiny random pair, built in a temp dir)")
    p.add_argument("--draft", help="drafter folder; give it with --model")
    p.add_argument("--concurrency", type=int, default=32,
                   help="requests in flight; also the servers' --max-running-requests, queue 4x (default: 32)")
    p.add_argument("--algorithm", default="ar", choices=("ar", "dflash", "ddtree"),
                   help="the servers' --algorithm and the one every request asks for (default: ar)")
    p.add_argument("--budget", type=int, default=8, help="speculative budget sent with each request (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per point (default: 4 x --concurrency)")
    p.add_argument("--repeats", type=int, default=3, help="measured points per variant, interleaved A B A B (default: 3)")
    p.add_argument("--prompt-chars", type=int, default=300,
                   help="cut each prompt to this many characters, so prompt + new tokens fit the tiny "
                        "pair's 512-token window (default: 300)")
    p.add_argument("--variant", action="append", default=[], type=parse_variant, metavar="LABEL=ARGS",
                   help="another server: the common flags followed by ARGS (split like a shell would), "
                        "e.g. \"thread=--engine-loop thread\"; repeatable (default: none)")
    p.add_argument("--baseline", metavar="REV",
                   help="also the default server run from a git worktree of REV, the code before a change "
                        "(the worktree is removed at the end; default: none)")
    p.add_argument("--without", metavar="MODULES", type=lambda t: [m for m in t.split(",") if m],
                   help="also the default server with these modules (comma-separated) made unimportable, "
                        "e.g. uvloop,httptools: what the server costs without them (default: none)")
    p.add_argument("--out", metavar="FILE.json", help="write every point and the medians here (default: none)")
    p.add_argument("--py-spy", metavar="STEM", default=None,
                   help="py-spy samples of each measured point's first HTTP process, every thread with "
                        "waits and the GIL holder only, into STEM-LABEL-rN{,-gil}.txt (bench/py_spy.py; "
                        "bench/py_spy_summary.py reads them)")
    p.add_argument("--keep-logs", metavar="DIR",
                   help="write the servers' logs here and keep them (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if (args.model is None) != (args.draft is None):
        p.error("--model and --draft go together")
    for name in ("concurrency", "budget", "max_new_tokens", "repeats", "prompt_chars"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    labels = [DEFAULT_LABEL] + [v.label for v in args.variant]
    if len(set(labels)) != len(labels):
        p.error(f"variant labels must differ, got {', '.join(labels)}")
    if args.baseline:
        try:
            git("rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}")
        except RuntimeError:
            p.error(f"--baseline {args.baseline!r} is not a revision of {ROOT}")
    return args


def run(args: argparse.Namespace, stack: ExitStack, report: dict) -> list[dict]:
    from ddtree.engine.serving.bench import BenchConfig
    from ddtree.engine.serving.prompts import Prompt, load_prompts

    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-http-")))
    if args.model:
        model, draft = args.model, args.draft
    else:
        from tests.support.pair import build_tiny_pair

        model, draft = (str(d) for d in build_tiny_pair(workdir / "pair"))
    report["model"], report["draft"] = model, draft
    log_dir = Path(args.keep_logs) if args.keep_logs else workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    n = args.num_prompts or 4 * args.concurrency
    prompts = [Prompt(text=p.text[:args.prompt_chars]) for p in load_prompts("builtin:code", n, seed=0)]
    cfg = BenchConfig(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, temperature=0.0,
                      speculative={"algorithm": args.algorithm, "budget": args.budget})
    common = server_flags(model, draft, args.concurrency, threads=1, batch=True) + ["--algorithm", args.algorithm]
    report["common_flags"] = common

    variants = [Variant(DEFAULT_LABEL), *args.variant]
    if args.without:
        variants.append(without_modules(args.without, stack))
    if args.baseline:
        variants.append(baseline_tree(args.baseline, stack))
    report["variants"] = [{"label": v.label, "extra": list(v.extra), "rev": v.rev} for v in variants]

    servers = []
    for variant in variants:
        print(f"starting {variant.label}: {shlex.join(variant.extra) or '(common flags only)'}"
              f"{f' from {variant.rev[:12]}' if variant.rev else ''}", flush=True)
        server = Server(variant, common, log_dir)
        stack.callback(server.stop)
        servers.append(server)
    for server in servers:
        warm = measure(server, prompts[:2], cfg)
        report_failures(warm)
        server.find_children()

    points = report["points"]
    for r in range(args.repeats):
        for server in servers:
            with sampled(args.py_spy, server.main.pid, f"{server.variant.label}-r{r}"):
                point = dict(measure(server, prompts, cfg), repeat=r)
            points.append(point)
            print(f"  repeat {r} {point['variant']}: {fmt(point['tok_s'])} tok/s, {point['tokens']} tokens, "
                  f"us/token http {fmt(point['http_us'])} (busiest {fmt(point['busiest_http_us'])}) "
                  f"engine {fmt(point['engine_us'])} "
                  f"client {fmt(point['client_us'])}", flush=True)
            report_failures(point)
    return report["points"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict = {"command": shlex.join([sys.executable, *sys.argv]), "machine": machine(),
                    "load_avg_start": os.getloadavg(), "args": vars(args) | {"variant": [v.label for v in args.variant]},
                    "points": []}
    print(f"machine: {report['machine']['platform']}, {report['machine']['cpu'] or 'cpu ?'}, "
          f"{report['machine']['cpu_count']} cpus ({report['machine']['cpus_usable']} usable), "
          f"load {' '.join(f'{x:.2f}' for x in report['load_avg_start'])}", flush=True)
    print(f"command: {report['command']}", flush=True)
    status = 0
    try:
        with ExitStack() as stack:  # stops the servers, then removes the worktree and temp dir
            run(args, stack, report)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        status = 130
    except Exception as exc:  # the boundary: one message, not a traceback (the log tail is in it)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    report["load_avg_end"] = os.getloadavg()
    labels = [v["label"] for v in report.get("variants", [])]
    report["summary"] = summarize(labels, report["points"]) if report["points"] else []
    if report["summary"]:
        print(f"\nc={args.concurrency} {args.algorithm} budget {args.budget}, {args.max_new_tokens} new tokens, "
              f"{args.num_prompts or 4 * args.concurrency} prompts of <= {args.prompt_chars} chars, "
              f"medians of {args.repeats}; CPU us per output token")
        print_table(report["summary"])
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in report['load_avg_end'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
