"""Benchmark the builtin server: throughput and TTFT at several concurrencies, ar vs dflash vs ddtree.

    .venv/bin/python bench/bench_server.py [--model DIR --draft DIR] [--concurrency 1,4,8]
        [--budgets 4,8,16,32] [--num-prompts 16] [--max-new-tokens 64] [--out FILE.json]

1. Starts `python -m ddtree.engine.reference.server` (the demo pair by default; a tiny random pair
   when the demo pair is not there yet) on a free port.
2. At concurrency 1 sweeps the DDTree budget and keeps the best by output tokens/s.
3. At each concurrency runs ar, dflash and ddtree@best side by side (same prompts, same server,
   warm-up left out): output tok/s, TTFT p50/p99, tau, and the ratio to ar at that concurrency.
4. Stops the server, then measures in-process whether batching verification across requests would
   pay on this device: one target forward over k sequences of (budget+1) tokens against k forwards
   of one sequence, with a context of --context tokens each; and what share of a DDTree round the
   verify forward is (the most batching it could save).

Results print as tables and go to --out as JSON. Numbers are medians of --repeats timings.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resolve_pair(args: argparse.Namespace, workdir: Path) -> tuple[str, str, str]:
    if args.model:
        return args.model, args.draft, "given"
    try:
        from ddtree.engine.demo import demo_paths

        target, drafter = demo_paths()
        if Path(target).is_dir() and Path(drafter).is_dir():
            return str(target), str(drafter), "demo"
    except Exception as exc:  # the demo pair may not exist yet on this checkout
        print(f"demo pair unavailable ({type(exc).__name__}: {exc}); using a tiny random pair", file=sys.stderr)
    sys.path.insert(0, str(ROOT))
    from tests.server.conftest import build_tiny_pair

    target, drafter = build_tiny_pair(workdir / "tiny-pair")
    return str(target), str(drafter), "tiny-random"


def start_server(model: str, draft: str, max_running: int, log_path: Path,
                 threads: int | None) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "ddtree.engine.reference.server", "--model", model, "--draft", draft,
            "--port", "0", "--max-running-requests", str(max_running), "--max-queued-requests", str(4 * max_running)]
    if threads:
        argv += ["--threads", str(threads)]
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if not line:
                break
            return proc, json.loads(line)["url"]
    proc.kill()
    raise SystemExit(f"server did not start; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def point(url: str, prompts, warm, concurrency: int, max_new_tokens: int, speculative: dict) -> dict:
    from ddtree.engine.bench import BenchConfig, run_point

    cfg = BenchConfig(concurrency=concurrency, max_new_tokens=max_new_tokens, temperature=0.0,
                      warmup=len(warm), speculative=speculative)
    result = run_point(url, prompts, cfg, warmup_prompts=warm)
    m = result.metrics
    return {k: m.get(k) for k in ("requests_ok", "requests_failed", "output_tok_s", "ttft_p50", "ttft_p99",
                                  "itl_p50", "e2e_p50", "tau_mean", "tau_weighted")}


def serving_bench(args: argparse.Namespace, url: str) -> dict:
    from ddtree.engine.prompts import load_prompts

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    out: dict = {"budget_sweep": {}, "points": []}
    sweep_prompts = load_prompts(args.dataset, args.num_prompts // 2 or 1, seed=1)
    warm = load_prompts(args.dataset, 2, seed=1, offset=1000)
    for budget in budgets:
        out["budget_sweep"][budget] = point(url, sweep_prompts, warm, 1, args.max_new_tokens,
                                            {"algorithm": "ddtree", "budget": budget})
        print(f"  budget {budget:4d}: {out['budget_sweep'][budget]['output_tok_s']:.1f} tok/s, "
              f"tau {out['budget_sweep'][budget]['tau_weighted']}", flush=True)
    best = max(budgets, key=lambda b: out["budget_sweep"][b]["output_tok_s"] or 0.0)
    out["best_budget"] = best
    for c in concurrencies:
        prompts = load_prompts(args.dataset, max(args.num_prompts, 2 * c), seed=0)
        warm = load_prompts(args.dataset, min(c, 4), seed=0, offset=1000)
        row = {}
        for name, spec in (("ar", {"algorithm": "ar"}), ("dflash", {"algorithm": "dflash"}),
                           (f"ddtree@{best}", {"algorithm": "ddtree", "budget": best})):
            row[name] = point(url, prompts, warm, c, args.max_new_tokens, spec)
        ar = row["ar"]["output_tok_s"] or float("nan")
        for name, m in row.items():
            m["speedup_vs_ar"] = (m["output_tok_s"] or 0.0) / ar
            out["points"].append({"concurrency": c, "algorithm": name, **m})
            print(f"  c={c:3d} {name:12s} {m['output_tok_s']:8.1f} tok/s  x{m['speedup_vs_ar']:.2f} vs ar  "
                  f"ttft p50 {1000 * (m['ttft_p50'] or 0):7.1f} ms  p99 {1000 * (m['ttft_p99'] or 0):7.1f} ms  "
                  f"tau {m['tau_weighted']}", flush=True)
    return out


def batching_bench(args: argparse.Namespace, model: str, draft: str, budget: int) -> dict:
    """Would verifying k requests in one forward beat k forwards? Timed in this process."""
    import torch

    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
    from ddtree.engine.prompts import load_prompts

    engine = Engine.load(model, draft, device=args.device)
    net = engine.model
    cache_kw = engine.target.cache_kwarg
    vocab = engine.target.vocab_size
    q, ctx = budget + 1, args.context
    neg = torch.finfo(engine.dtype).min

    def verifier(k: int, seed: int):
        """A k-sequence cache holding ctx tokens each, and a function timing one verify forward on it."""
        gen = torch.Generator().manual_seed(seed)
        cache = engine.target.new_cache()  # KVCache: crop(length) works across transformers versions
        with torch.inference_mode():
            net(input_ids=torch.randint(4, vocab, (k, ctx), generator=gen), use_cache=True,
                **{cache_kw: cache.cache})
        mask = torch.zeros(k, 1, q, ctx + q, dtype=engine.dtype)
        mask[:, :, :, ctx:] = torch.triu(torch.full((q, q), neg, dtype=engine.dtype), diagonal=1)
        positions = torch.arange(ctx, ctx + q).expand(k, q)

        def run() -> float:
            ids = torch.randint(4, vocab, (k, q), generator=gen)
            with torch.inference_mode():
                t0 = time.perf_counter()
                net(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                    **{cache_kw: cache.cache})
                elapsed = time.perf_counter() - t0
            cache.crop(ctx)
            return elapsed

        return run

    rows = []
    for k in (1, 2, 4, 8):
        batched = verifier(k, seed=k)
        singles = [verifier(1, seed=100 * k + i) for i in range(k)]
        for _ in range(3):  # warm-up: first calls of a shape pay for allocation
            batched()
            singles[0]()
        ratios, batched_t, single_t = [], [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both sides alike
            b = batched()
            s = sum(one() for one in singles)
            batched_t.append(b)
            single_t.append(s)
            ratios.append(s / b)
        row = {"k": k, "batched_ms": 1000 * statistics.median(batched_t),
               "k_singles_ms": 1000 * statistics.median(single_t), "gain": statistics.median(ratios)}
        rows.append(row)
        print(f"  verify k={k}: one batched forward {row['batched_ms']:7.2f} ms vs {k} single forwards "
              f"{row['k_singles_ms']:7.2f} ms -> x{row['gain']:.2f} (median of {args.repeats})", flush=True)
    prompt = load_prompts(args.dataset, 1, seed=0)[0].text
    ids = list(engine.tokenizer.encode(prompt))
    engine.generate(ids, GenParams(max_new_tokens=8), SpecParams("ddtree", budget))
    engine.sync_timings = True
    res = engine.generate(ids, GenParams(max_new_tokens=args.max_new_tokens, ignore_eos=True),
                          SpecParams("ddtree", budget))
    total = sum(res.timings.values()) or 1.0
    shares = {k: v / total for k, v in res.timings.items()}
    print("  DDTree round time shares: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()), flush=True)
    return {"context": ctx, "tokens_per_request": q, "verify": rows, "round_shares": shares,
            "torch_threads": torch.get_num_threads()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dataset", default="builtin:code")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--budgets", default="4,8,16,32")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="context tokens per request in the batching timing")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--out", default=None, help="JSON results (default: bench_server.json in a temp folder)")
    args = p.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-server-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, draft, kind = resolve_pair(args, workdir)
    report: dict = {"pair": kind, "model": model, "draft": draft, "cpus": os.cpu_count(),
                    "load_avg_start": os.getloadavg()}
    print(f"pair: {kind} ({model}, {draft})", flush=True)
    best = int(args.budgets.split(",")[0])
    if not args.skip_serving:
        proc, url = start_server(model, draft, max(int(c) for c in args.concurrency.split(",")),
                                 workdir / "server.log", args.threads)
        try:
            report["serving"] = serving_bench(args, url)
            best = report["serving"]["best_budget"]
        finally:
            stop_server(proc)
    print("batching verification across requests:", flush=True)
    report["batching"] = batching_bench(args, model, draft, best)
    report["load_avg_end"] = os.getloadavg()
    out = Path(args.out) if args.out else workdir / "bench_server.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
