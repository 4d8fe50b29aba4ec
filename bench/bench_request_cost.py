"""One request at a time through the builtin server against in process: the fixed cost of a request
and the cost of each further token, with the engine's own time per turn from the server's /metrics.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_request_cost.py [--model DIR --draft DIR]
        [--tokens 33] [--requests 60] [--repeats 3] [--baseline REV] [--out FILE.json]

Per side (this tree, and with --baseline REV the server and the in-process engine of a git worktree
of REV, alternated repeat by repeat): a server on the pair (the tests' tiny random pair unless
--model/--draft; --threads 1), sequential non-streaming AR requests of a 55-token prompt asking
for 1 token and for --tokens tokens, medians over --requests each; then the same through
`Engine.generate` in a fresh process. Reported: the server's and in-process ms for both lengths,
the fixed cost (server less in process at 1 token), ms per further token on each side, and, over
the longer requests only (each one's prefill turn among its turns), the engine's seconds per
scheduler turn and the turn's own (the differences of ddtree:engine_seconds_total and
ddtree:scheduler_turn_seconds_total over ddtree:scheduler_turns_total, read from /metrics before
and after): what the engine process spends inside the engine's calls and around them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = list(range(5, 60))


def request(n: int) -> dict:
    return {"input_ids": PROMPT, "stream": False, "speculative": {"algorithm": "ar"},
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def server_side(model: str, draft: str, tokens: int, requests: int, log: Path) -> dict:
    import httpx

    from ddtree.engine.serving.bench import wait_ready
    from tests.support.server import SERVER, ServerProcess

    srv = ServerProcess([*SERVER, "--model", model, "--draft", draft, "--port", "0", "--threads", "1", "--batch"], log)
    try:
        wait_ready(srv.url, timeout_s=120)
        out, counters = {}, []
        names = ("ddtree:scheduler_turns_total", "ddtree:engine_seconds_total", "ddtree:scheduler_turn_seconds_total")
        with httpx.Client(timeout=120) as c:
            for _ in range(20):
                c.post(srv.url + "/generate", json=request(1)).raise_for_status()
            for n in (1, tokens):
                if n == tokens:
                    counters.append([metric(c.get(srv.url + "/metrics").text, name) for name in names])
                times = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    c.post(srv.url + "/generate", json=request(n)).raise_for_status()
                    times.append(time.perf_counter() - t0)
                out[n] = statistics.median(times) * 1e3
            counters.append([metric(c.get(srv.url + "/metrics").text, name) for name in names])
        turns, engine_s, turn_s = (after - before for before, after in zip(*counters))
        return {"ms_1": out[1], "ms_n": out[tokens], "engine_ms_per_turn": 1e3 * engine_s / turns,
                "turn_ms": 1e3 * turn_s / turns}
    finally:
        srv.stop(30)


def inprocess_side(model: str, draft: str, tokens: int, requests: int) -> dict:
    import torch

    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    torch.set_num_threads(1)
    engine = Engine.load(model, draft, device="cpu")
    out = {}
    for n in (1, tokens):
        gen = GenParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        for _ in range(10):
            engine.generate(PROMPT, gen, SpecParams(algorithm="ar"))
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            engine.generate(PROMPT, gen, SpecParams(algorithm="ar"))
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times) * 1e3
    return {"ms_1": out[1], "ms_n": out[tokens]}


def child(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        try:
            server = server_side(args.model, args.draft, args.tokens, args.requests, log)
        except Exception:
            if log.exists():  # the server's own account, before its folder goes
                print(log.read_text(errors="replace")[-2000:], file=sys.stderr)
            raise
    row = {"server": server, "in_process": inprocess_side(args.model, args.draft, args.tokens, args.requests)}
    print(json.dumps(row))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="target folder (default: the tests' tiny random pair, built in a temp dir)")
    p.add_argument("--draft", help="drafter folder; give it with --model")
    p.add_argument("--tokens", type=int, default=33, help="the longer requests' new tokens (default: 33)")
    p.add_argument("--requests", type=int, default=60, help="timed requests per length and side (default: 60)")
    p.add_argument("--repeats", type=int, default=3, help="alternations of the sides (default: 3)")
    p.add_argument("--baseline", metavar="REV", help="also the code of a git worktree of REV")
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens < 2 or min(args.requests, args.repeats) < 1:
        p.error("--tokens must be >= 2, --requests and --repeats >= 1")
    if args.child:
        return child(args)
    with ExitStack() as stack:
        if args.model is None:
            from tests.support.pair import build_tiny_pair

            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            target, drafter = build_tiny_pair(root)
            args.model, args.draft = str(target), str(drafter)
        sides = [("this tree", {})]
        if args.baseline:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_http_side import baseline_tree

            base = baseline_tree(args.baseline, stack)
            sides.append((base.label, base.env))
        print(f"command: {' '.join([sys.executable, *sys.argv])}", flush=True)
        rows = []
        for r in range(args.repeats):
            for label, env in sides:
                argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model,
                        "--draft", args.draft, "--tokens", str(args.tokens), "--requests", str(args.requests)]
                # No timeout here: killing the child would leave its server running (a session of
                # its own); the child's own calls all have one.
                done = subprocess.run(argv, capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", **env})
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                row = dict(json.loads(done.stdout.strip().splitlines()[-1]), side=label, repeat=r)
                rows.append(row)
                s, i, n = row["server"], row["in_process"], args.tokens
                print(f"  {r} {label:>18}: server {s['ms_1']:.2f} / {s['ms_n']:.2f} ms, in process {i['ms_1']:.2f} / "
                      f"{i['ms_n']:.2f} ms; fixed {s['ms_1'] - i['ms_1']:.2f} ms; per further token server "
                      f"{(s['ms_n'] - s['ms_1']) / (n - 1):.3f} in process {(i['ms_n'] - i['ms_1']) / (n - 1):.3f} ms; "
                      f"engine {s['engine_ms_per_turn']:.3f} of a {s['turn_ms']:.3f} ms turn", flush=True)
        print(f"\nmedians over {args.repeats} repeats, 1 and {args.tokens} new tokens")
        print(f"{'side':>18} {'fixed ms':>9} {'srv ms/tok':>11} {'in-proc ms/tok':>15} {'engine ms/turn':>15} {'turn ms':>8}")
        summary = []
        for label, _ in sides:
            mine = [x for x in rows if x["side"] == label]

            def med(fn) -> float:
                return statistics.median(fn(x) for x in mine)

            n = args.tokens
            line = {"side": label,
                    "fixed_ms": med(lambda x: x["server"]["ms_1"] - x["in_process"]["ms_1"]),
                    "server_ms_per_token": med(lambda x: (x["server"]["ms_n"] - x["server"]["ms_1"]) / (n - 1)),
                    "inprocess_ms_per_token": med(lambda x: (x["in_process"]["ms_n"] - x["in_process"]["ms_1"]) / (n - 1)),
                    "engine_ms_per_turn": med(lambda x: x["server"]["engine_ms_per_turn"]),
                    "turn_ms": med(lambda x: x["server"]["turn_ms"])}
            summary.append(line)
            print(f"{label:>18} {line['fixed_ms']:9.2f} {line['server_ms_per_token']:11.3f} "
                  f"{line['inprocess_ms_per_token']:15.3f} {line['engine_ms_per_turn']:15.3f} {line['turn_ms']:8.3f}")
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
