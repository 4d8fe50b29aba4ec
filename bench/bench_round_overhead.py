"""What a decoding round costs through the builtin server against in process, side by side.

    .venv/bin/python bench/bench_round_overhead.py [--model DIR --draft DIR] [--num-prompts 12]
        [--max-new-tokens 64] [--budget 16] [--repeats 5] [--threads N] [--no-batch] [--out FILE.json]

One request at a time, the same prompts (token ids, so both sides prefill the same thing), T=0,
ignore_eos so every request decodes --max-new-tokens tokens. Each repeat runs, for ar and for
ddtree-BUDGET, every prompt through `Engine.generate` in this process and through POST /generate
on a `python -m ddtree.engine.reference.server` subprocess of the same pair (the demo pair by
default), in an order that alternates between repeats, so drift in the machine's load hits both
sides alike. Only one side works at a time.

Reported per (algorithm, side): medians over repeats of output tok/s and of ms per round (a
request's time over its verify rounds, the prefill folded in), tau (tokens per round), and the
server / in-process ratio of ms per round, pair by pair. The server's time is the client's (HTTP
included); its own e2e_latency (queue to last token) is reported too, so the HTTP share shows.

Also per round, from the kernel's accounting (Linux /proc; this process for in-process, the server
process's threads for the server): CPU ms and voluntary context switches. These move far less
with the machine's load than wall time does, and they show how torch's OpenMP workers wait: a
worker that sleeps between parallel regions costs a voluntary switch each time it is woken.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: client, server process

SIDES = ("in-process", "server")


def process_counters(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, voluntary context switches) summed over the threads of a process, or None
    where /proc cannot say."""
    cpu, switches = 0.0, 0
    hz = os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{task}/status") as f:
                status = f.read()
        except OSError:
            continue  # a thread that ended meanwhile
        cpu += (int(fields[11]) + int(fields[12])) / hz
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                switches += int(line.split()[1])
    return cpu, switches


def counted(pid: int, fn, *args) -> dict:
    """fn(*args), with the CPU seconds and voluntary switches of process pid over it."""
    before = process_counters(pid)
    run = fn(*args)
    after = process_counters(pid)
    if before is not None and after is not None:
        run["cpu_seconds"], run["switches"] = after[0] - before[0], after[1] - before[1]
    return run


def start_server(model: str, draft: str, threads: int | None, batch: bool, log_path: Path):
    """A builtin server subprocess (tests/support/server.py's ServerProcess), with this process's
    thread settings rather than the tests' one thread."""
    from tests.support.server import SERVER, ServerProcess

    argv = [*SERVER, "--model", model, "--draft", draft, "--port", "0", "--max-running-requests", "4",
            "--batch" if batch else "--no-batch"]
    if threads:
        argv += ["--threads", str(threads)]
    return ServerProcess(argv, log_path, timeout_s=300, env={})


def run_in_process(engine, prompts: list[list[int]], spec, max_new: int) -> dict:
    from ddtree.engine.reference.engine import GenParams

    gen = GenParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    tokens = rounds = 0
    elapsed = 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        result = engine.generate(ids, gen, spec)
        elapsed += time.perf_counter() - t0
        tokens += len(result.output_ids)
        rounds += result.verify_ct
    return {"tokens": tokens, "rounds": rounds, "seconds": elapsed, "server_seconds": None,
            "tau": tokens / rounds if rounds else None}


def run_server(client, prompts: list[list[int]], spec, max_new: int) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    speculative = {"algorithm": spec.algorithm, "budget": spec.budget}
    tokens = rounds = 0
    elapsed = server_elapsed = 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        out = client.generate(input_ids=ids, sampling_params=params, speculative=speculative)
        elapsed += time.perf_counter() - t0
        meta = out["meta_info"]
        server_elapsed += meta["e2e_latency"]
        n = len(out["output_ids"])
        tokens += n
        # Plain decoding reports no verify rounds; it runs one per token after the prefill's.
        rounds += meta.get("spec_verify_ct") or (n - 1)
    return {"tokens": tokens, "rounds": rounds, "seconds": elapsed, "server_seconds": server_elapsed,
            "tau": tokens / rounds if rounds else None}


def summarise(runs: list[dict]) -> dict:
    tok_s = [r["tokens"] / r["seconds"] for r in runs]
    ms_round = [1000 * r["seconds"] / r["rounds"] for r in runs]
    out = {"tok_s_median": statistics.median(tok_s), "tok_s_min": min(tok_s), "tok_s_max": max(tok_s),
           "ms_per_round_median": statistics.median(ms_round), "tau": runs[0]["tau"],
           "rounds": runs[0]["rounds"], "tokens": runs[0]["tokens"], "cpu_ms_per_round_median": None,
           "switches_per_round_median": None}
    if all("cpu_seconds" in r for r in runs):
        out["cpu_ms_per_round_median"] = statistics.median(1000 * r["cpu_seconds"] / r["rounds"] for r in runs)
        out["switches_per_round_median"] = statistics.median(r["switches"] / r["rounds"] for r in runs)
    if runs[0]["server_seconds"] is not None:
        out["server_ms_per_round_median"] = statistics.median(1000 * r["server_seconds"] / r["rounds"] for r in runs)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--dataset", default="builtin:code")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server")
    p.add_argument("--batch", action=argparse.BooleanOptionalAction, default=True,
                   help="serve with batched rounds, the server's default (one request at a time either way)")
    p.add_argument("--out", default=None, help="JSON results (default: a file in a temp folder)")
    args = p.parse_args()

    import torch

    from tests.support.client import EngineClient
    from ddtree.engine.serving.prompts import load_prompts
    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    if args.threads:
        torch.set_num_threads(args.threads)
    model, draft = args.model, args.draft
    if model is None:
        from ddtree.engine.demo import demo_paths

        target_dir, drafter_dir = demo_paths()
        model, draft = str(target_dir), str(drafter_dir)
    engine = Engine.load(model, draft, device="cpu")
    prompts = [list(engine.tokenizer.encode(p.text)) for p in load_prompts(args.dataset, args.num_prompts, seed=0)]
    warm = [list(engine.tokenizer.encode(p.text)) for p in load_prompts(args.dataset, 2, seed=0, offset=1000)]
    specs = {"ar": SpecParams(algorithm="ar"), f"ddtree-{args.budget}": SpecParams(algorithm="ddtree",
                                                                                     budget=args.budget)}
    workdir = Path(tempfile.mkdtemp(prefix="bench-round-overhead-"))
    server = start_server(model, draft, args.threads, args.batch, workdir / "server.log")
    runs: dict[tuple[str, str], list[dict]] = {(name, side): [] for name in specs for side in SIDES}
    try:
        with EngineClient(server.url, timeout=600) as client:
            for spec in specs.values():  # warm-up, unmeasured
                run_in_process(engine, warm, spec, args.max_new_tokens)
                run_server(client, warm, spec, args.max_new_tokens)
            for r in range(args.repeats):
                for name, spec in specs.items():
                    for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                        if side == "in-process":
                            run = counted(os.getpid(), run_in_process, engine, prompts, spec, args.max_new_tokens)
                        else:
                            run = counted(server.proc.pid, run_server, client, prompts, spec, args.max_new_tokens)
                        runs[(name, side)].append(run)
                print(f"  repeat {r + 1}/{args.repeats} done", flush=True)
    finally:
        server.stop(60)

    table = {f"{name} {side}": summarise(runs[(name, side)]) for name, side in runs}
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, one request at a time, "
          f"medians of {args.repeats} repeats; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, batch={args.batch}")
    print(f"{'':22s} {'tok/s':>8s} {'(min-max)':>15s} {'ms/round':>9s} {'srv ms/rd':>9s} {'tau':>5s} "
          f"{'cpu ms/rd':>9s} {'vol.sw/rd':>9s}")

    def cell(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for name in specs:
        for side in SIDES:
            s = table[f"{name} {side}"]
            print(f"{name + ' ' + side:22s} {s['tok_s_median']:8.1f} "
                  f"({s['tok_s_min']:6.1f}-{s['tok_s_max']:6.1f}) {s['ms_per_round_median']:9.2f} "
                  f"{cell(s.get('server_ms_per_round_median'), '.2f'):>9s} {s['tau']:5.2f} "
                  f"{cell(s['cpu_ms_per_round_median'], '.2f'):>9s} {cell(s['switches_per_round_median'], '.1f'):>9s}")
        inp, srv = table[f"{name} in-process"], table[f"{name} server"]
        ratios = [(b["seconds"] / b["rounds"]) / (a["seconds"] / a["rounds"])
                  for a, b in zip(runs[(name, "in-process")], runs[(name, "server")])]
        table[f"{name} ratio"] = {"ms_per_round_server_over_in_process_median": statistics.median(ratios),
                                  "extra_ms_per_round": srv["ms_per_round_median"] - inp["ms_per_round_median"]}
        print(f"{name + ' server/in-proc':22s} ms/round x{statistics.median(ratios):.3f} (pairwise median), "
              f"+{srv['ms_per_round_median'] - inp['ms_per_round_median']:.2f} ms")
    out_path = Path(args.out) if args.out else workdir / "bench_round_overhead.json"
    out_path.write_text(json.dumps({"args": vars(args), "machine": {"cpus": os.cpu_count(),
                                                                    "processor": platform.processor(),
                                                                    "torch_threads": torch.get_num_threads()},
                                    "results": table}, indent=2))
    print(f"results: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
