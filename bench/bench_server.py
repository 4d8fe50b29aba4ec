"""Benchmark the builtin server: throughput and TTFT at several concurrencies, ar vs dflash vs
ddtree, with batched rounds (--batch) against one request per forward (--no-batch); with --grid,
issue 15's table: one batching server against the same loop in process.

    .venv/bin/python bench/bench_server.py [--model DIR --draft DIR | --random-shape demo|1.7b|8b]
        [--device cpu|cuda] [--backend auto|fast|transformers] [--dtype auto|float32|bfloat16]
        [--concurrency 1,4,8] [--budgets 4,8,16,32] [--algorithms ar,dflash,ddtree]
        [--num-prompts 16] [--max-new-tokens 64] [--threads 1] [--skip-serving] [--skip-batching]
        [--grid [--skip-inprocess] [--again thread,busy2]] [--verify-grid [--verify-b 1,4,16,64] [--verify-q 1,17,65]]
        [--time-budget SECONDS] [--out FILE.json]

On a GPU, for the issue-5 figures (bench/RESULTS.md):
    python bench/bench_server.py --device cuda --random-shape 1.7b --concurrency 1,4,16 --budgets 16
For issue 15's (bench/serving_grid.py says what each part measures):
    python bench/bench_server.py --device cuda --random-shape 1.7b --grid --verify-grid --skip-batching \
        --time-budget 540 --out grid-1.7b.json

Without --grid:
1. Starts two `python -m ddtree.engine.reference.server` processes on free ports, one with
   --batch and one with --no-batch (the demo pair by default; when it is not there yet, a random
   pair of the demo's shape: Qwen3 hidden 256, 8 layers, vocab 4096, 2-layer drafter, block 16).
   Only one of them works at a time. Each server prefills every prompt once, unmeasured.
2. At concurrency 1 sweeps the DDTree budget (on the batching server) and keeps the best by
   output tokens/s.
3. At each concurrency runs ar, dflash and ddtree@best on both servers, back to back in an order
   that alternates (same prompts, warm-up left out): output tok/s, TTFT p50/p99, tau, the ratio to
   ar at that concurrency, and the ratio batched / not batched.
4. Stops the servers, then measures in-process on the transformers backend (a) one target
   forward over k sequences of (budget+1) tokens against k forwards of one sequence, with a
   context of --context tokens each; (b) whole generations of k sessions stepped with
   Engine.step_many against the same k sessions stepped one by one, interleaved, medians of
   --repeats/3 (at least 3); (c) what share of a DDTree round the verify forward is.

With --grid (defaults then: --concurrency 1,4,16,64 --budgets 16,64), per concurrency and
algorithm (ar, dflash, ddtree@each budget), --num-prompts or --waves x concurrency prompts, whichever
is more: the server's output tok/s, TTFT p50/p99, ITL p50/p99 and tau through the sweep client,
then the same cells in process with the server's engine and loop, server / in-process per cell,
AR throughput c=16 / c=1, the DDTree-vs-AR crossover, and the issue's targets. --verify-grid:
one batched verify forward's ms by rows b and tokens per row q at --context tokens of context.

Results print as tables and go to --out as JSON. Numbers are medians of --repeats timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support: the tests' tokenizer and server process


from bench_engine import SHAPES as ENGINE_SHAPES  # noqa: E402  (this folder is sys.path[0])


def published_shape(name: str, tied: bool, draft_layers: int) -> tuple:
    """bench_engine's shape of a published model, in this file's order, with the embedding tying
    of that model and a drafter depth (Qwen3-1.7B ties its embeddings, Qwen3-8B does not)."""
    hidden, inter, layers, heads, kv, _head_dim, vocab = ENGINE_SHAPES[name]
    return (hidden, layers, inter, heads, kv, vocab, tied, draft_layers)


# Random pairs: (target hidden, layers, intermediate, heads, kv heads, vocab, tied embeddings,
# drafter layers). "1.7b" and "8b" are Qwen3's; "demo" is the demo recipe's
# (engine/reference/train_demo.py).
SHAPES = {
    "demo": (256, 8, 768, 4, 2, 4096, False, 2),
    "1.7b": published_shape("1.7b", tied=True, draft_layers=4),
    "8b": published_shape("8b", tied=False, draft_layers=5),
}


def weights_dtype(args: argparse.Namespace) -> str:
    """The dtype name --dtype resolves to for a random pair: as the server's auto, bfloat16 on a
    GPU and float32 on a CPU."""
    if args.dtype != "auto":
        return args.dtype
    return "float32" if args.device == "cpu" else "bfloat16"


def build_random_pair(root: Path, shape: str, device: str, dtype_name: str | None = None) -> tuple[str, str]:
    """A random Qwen3 target of `shape` (in `dtype_name`; by default bf16 on CUDA) with a random DFlash drafter (block 16) and
    the tests' small tokenizer; the vocab is padded to the shape's. Weights are random, so tau is
    about 1: this measures cost, not acceptance."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.support.pair import build_tokenizer

    from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids, save_drafter

    hidden, layers, inter, heads, kv, vocab, tied, draft_layers = SHAPES[shape]
    target_dir, drafter_dir = root / "target", root / "drafter"
    vocab = max(vocab, build_tokenizer(target_dir))
    config_path = target_dir / "tokenizer_config.json"
    config_path.write_text(config_path.read_text().replace('"model_max_length": 512', '"model_max_length": 4096'))
    if dtype_name is None:
        dtype_name = "float32" if device == "cpu" else "bfloat16"
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    head_dim = 128 if hidden >= 1024 else hidden // heads
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      max_position_embeddings=4096, eos_token_id=0, tie_word_embeddings=tied)
    with torch.device(device):  # initialising 2B parameters on the CPU alone takes most of a minute
        model = Qwen3ForCausalLM(cfg).to(dtype)
        model.save_pretrained(target_dir)
        del model
        dcfg = DFlashConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=draft_layers,
                            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                            num_target_layers=layers, target_layer_ids=default_target_layer_ids(layers, draft_layers),
                            mask_token_id=3, block_size=16, head_dim=head_dim, max_position_embeddings=4096)
        save_drafter(DFlashDrafter(dcfg).to(dtype), drafter_dir)
    return str(target_dir), str(drafter_dir)


def resolve_pair(args: argparse.Namespace, workdir: Path) -> tuple[str, str, str]:
    if args.model:
        return args.model, args.draft, "given"
    if args.random_shape:
        t0 = time.perf_counter()
        target, drafter = build_random_pair(workdir / f"random-{args.random_shape}", args.random_shape, args.device,
                                            weights_dtype(args))
        print(f"built a random {args.random_shape}-shaped pair in {time.perf_counter() - t0:.0f} s", flush=True)
        return target, drafter, f"random, {args.random_shape}-shaped"
    try:
        from ddtree.engine.demo import demo_paths

        target, drafter = demo_paths()
        if Path(target).is_dir() and Path(drafter).is_dir():
            return str(target), str(drafter), "demo"
    except Exception as exc:  # the demo pair may not exist yet on this checkout
        print(f"demo pair unavailable ({type(exc).__name__}: {exc}); using a random pair of its shape",
              file=sys.stderr)
    return (*build_random_pair(workdir / "random-demo", "demo", args.device, weights_dtype(args)),
            "random, demo-shaped")


def server_flags(model: str, draft: str, max_running: int, threads: int | None, batch: bool = True,
                 device: str = "cpu", backend: str = "auto", dtype: str = "auto",
                 context_window: int | None = None, kv_pool_gb: float | None = None,
                 capture_budgets: tuple[int, ...] = ()) -> list[str]:
    """The builtin server's options for this bench (--grid parses them again to load its
    in-process engine exactly as the server does)."""
    flags = ["--model", model, "--draft", draft, "--device", device, "--port", "0",
             "--max-running-requests", str(max_running), "--max-queued-requests", str(4 * max_running),
             "--batch" if batch else "--no-batch", "--backend", backend, "--dtype", dtype]
    if threads:
        flags += ["--threads", str(threads)]
    if context_window:
        flags += ["--context-window", str(context_window)]
    if kv_pool_gb:
        flags += ["--kv-pool-gb", str(kv_pool_gb)]
    if capture_budgets:
        flags += ["--capture-budgets", ",".join(str(b) for b in capture_budgets)]
    return flags


def start_server(model: str, draft: str, max_running: int, log_path: Path,
                 threads: int | None, batch: bool = True, device: str = "cpu", backend: str = "auto",
                 dtype: str = "auto", context_window: int | None = None, flags: list[str] | None = None):
    """A builtin server subprocess (tests/support/server.py's ServerProcess), with this process's
    thread settings rather than the tests' one thread; `flags` replaces the options built from the rest."""
    from tests.support.server import SERVER, ServerProcess

    if flags is None:
        flags = server_flags(model, draft, max_running, threads, batch, device, backend, dtype, context_window)
    return ServerProcess([*SERVER, *flags], log_path, timeout_s=600, env={})


def point(url: str, prompts, warm, concurrency: int, max_new_tokens: int, speculative: dict) -> dict:
    from ddtree.engine.serving.bench import BenchConfig, run_point

    cfg = BenchConfig(concurrency=concurrency, max_new_tokens=max_new_tokens, temperature=0.0,
                      warmup=len(warm), speculative=speculative)
    result = run_point(url, prompts, cfg, warmup_prompts=warm)
    m = result.metrics
    return {k: m.get(k) for k in ("requests_ok", "requests_failed", "output_tok_s", "ttft_p50", "ttft_p99",
                                  "itl_p50", "e2e_p50", "tau_mean", "tau_weighted")}


def serving_bench(args: argparse.Namespace, urls: dict[str, str]) -> dict:
    """urls: {"batch": URL, "no-batch": URL}."""
    from ddtree.engine.serving.prompts import load_prompts

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    out: dict = {"budget_sweep": {}, "points": []}
    sweep_prompts = load_prompts(args.dataset, args.num_prompts // 2 or 1, seed=1)
    warm = load_prompts(args.dataset, 2, seed=1, offset=1000)
    # Prefill every prompt once on each server, unmeasured: on CUDA the first forward of a new
    # sequence length pays for kernel selection, which doubled the TTFT of whichever algorithm
    # happened to be measured first.
    every = load_prompts(args.dataset, max([args.num_prompts] + [2 * c for c in concurrencies]), seed=0)
    for url in urls.values():
        point(url, sweep_prompts + every, [], max(concurrencies), 2, {"algorithm": "ar"})
    for budget in budgets:
        out["budget_sweep"][budget] = point(urls["batch"], sweep_prompts, warm, 1, args.max_new_tokens,
                                            {"algorithm": "ddtree", "budget": budget})
        print(f"  budget {budget:4d}: {out['budget_sweep'][budget]['output_tok_s']:.1f} tok/s, "
              f"tau {out['budget_sweep'][budget]['tau_weighted']}", flush=True)
    best = max(budgets, key=lambda b: out["budget_sweep"][b]["output_tok_s"] or 0.0)
    out["best_budget"] = best
    modes = list(urls)
    specs = {"ar": {"algorithm": "ar"}, "dflash": {"algorithm": "dflash"},
             "ddtree": {"algorithm": "ddtree", "budget": best}}
    algorithms = [(f"ddtree@{best}" if a == "ddtree" else a, specs[a]) for a in args.algorithms.split(",")]
    names = [name for name, _ in algorithms]
    flip = 0
    for c in concurrencies:
        prompts = load_prompts(args.dataset, max(args.num_prompts, 2 * c), seed=0)
        warm = load_prompts(args.dataset, min(c, 4), seed=0, offset=1000)
        row: dict[str, dict] = {}
        for name, spec in algorithms:
            # Alternate which server goes first, so drift in machine load hits both alike.
            order = modes if flip % 2 == 0 else modes[::-1]
            flip += 1
            for mode in order:
                row[(name, mode)] = point(urls[mode], prompts, warm, c, args.max_new_tokens, spec)
        for mode in modes:
            ar = row[("ar", mode)]["output_tok_s"] or float("nan") if ("ar", mode) in row else float("nan")
            for name in names:
                row[(name, mode)]["speedup_vs_ar"] = (row[(name, mode)]["output_tok_s"] or 0.0) / ar
        for name in names:
            on, off = row[(name, "batch")], row[(name, "no-batch")]
            gain = (on["output_tok_s"] or 0.0) / (off["output_tok_s"] or float("nan"))
            for mode in modes:
                out["points"].append({"concurrency": c, "algorithm": name, "batch": mode == "batch",
                                      **row[(name, mode)], "batch_gain": gain})
            print(f"  c={c:3d} {name:12s} batch {on['output_tok_s']:8.1f} tok/s  no-batch {off['output_tok_s']:8.1f}"
                  f" tok/s  -> x{gain:.2f}   ttft p50 {1000 * (on['ttft_p50'] or 0):7.1f} / "
                  f"{1000 * (off['ttft_p50'] or 0):7.1f} ms  p99 {1000 * (on['ttft_p99'] or 0):7.1f} / "
                  f"{1000 * (off['ttft_p99'] or 0):7.1f} ms  x{on['speedup_vs_ar']:.2f} vs ar (batched)  "
                  f"tau {on['tau_weighted']}", flush=True)
    return out


def transformers_verifier(engine, k: int, q: int, ctx: int, seed: int):
    """A k-row batched cache holding ctx random tokens per row (transformers backend), and a
    function timing one verify forward of q tokens per row on it through `Target.forward_batch`
    (what batch.py calls), in seconds; the cache is cropped back to ctx after each."""
    import torch

    target = engine.target
    dev = torch.device(engine.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    neg = torch.finfo(engine.dtype).min
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    cache = target.new_cache()  # KVCache: crop(length) works across transformers versions
    prefill = {"logits_to_keep": 1} if target.has_logits_to_keep else {}  # [k, ctx, 150k] logits are GBs
    with torch.inference_mode():
        target.model(input_ids=torch.randint(4, vocab, (k, ctx), generator=gen).to(dev), use_cache=True,
                     **{target.cache_kwarg: cache.cache}, **prefill)
    mask = torch.zeros(k, 1, q, ctx + q, dtype=engine.dtype, device=dev)
    mask[:, :, :, ctx:] = torch.triu(torch.full((q, q), neg, dtype=engine.dtype, device=dev), diagonal=1)
    positions = torch.arange(ctx, ctx + q, device=dev).expand(k, q)

    def run() -> float:
        ids = torch.randint(4, vocab, (k, q), generator=gen).to(dev)
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            target.forward_batch(ids, positions, cache, mask)
            sync()
            elapsed = time.perf_counter() - t0
        cache.crop(ctx)
        return elapsed

    return run


def batching_bench(args: argparse.Namespace, model: str, draft: str, budget: int) -> dict:
    """Would verifying k requests in one forward beat k forwards? Timed in this process, on the
    transformers backend (its batched rounds are what this compares; --grid covers the others)."""
    import torch

    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
    from ddtree.engine.serving.prompts import load_prompts

    engine = Engine.load(model, draft, device=args.device, backend="transformers",
                         dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))
    q, ctx = budget + 1, args.context

    def verifier(k: int, seed: int):
        return transformers_verifier(engine, k, q, ctx, seed)

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
    rounds = []
    for k in (2, 4, 8):
        rounds.append(step_many_bench(engine, args, budget, k))
    prompt = load_prompts(args.dataset, 1, seed=0)[0].text
    ids = list(engine.tokenizer.encode(prompt))
    engine.generate(ids, GenParams(max_new_tokens=8), SpecParams("ddtree", budget))
    engine.sync_timings = True
    res = engine.generate(ids, GenParams(max_new_tokens=args.max_new_tokens, ignore_eos=True),
                          SpecParams("ddtree", budget))
    total = sum(res.timings.values()) or 1.0
    shares = {k: v / total for k, v in res.timings.items()}
    print("  DDTree round time shares: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()), flush=True)
    return {"context": ctx, "tokens_per_request": q, "verify": rows, "step_many": rounds, "round_shares": shares,
            "torch_threads": torch.get_num_threads()}


def step_many_bench(engine, args: argparse.Namespace, budget: int, k: int) -> dict:
    """k requests of different prompts decoded to the end: Engine.step_many vs one step at a time."""
    from ddtree.engine.serving.prompts import load_prompts
    from ddtree.engine.reference.engine import GenParams, SpecParams

    prompts = [list(engine.tokenizer.encode(p.text)) for p in load_prompts(args.dataset, k, seed=k)]
    gen = GenParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    out: dict = {"k": k}
    for name, spec in (("ar", SpecParams("ar")), (f"ddtree@{budget}", SpecParams("ddtree", budget))):

        def run(batched: bool) -> tuple[float, list[list[int]]]:
            sessions = [engine.start(p, gen, spec) for p in prompts]
            t0 = time.perf_counter()
            while not all(s.done for s in sessions):
                live = [s for s in sessions if not s.done]
                if batched:
                    engine.step_many(live)
                else:
                    for s in live:
                        s.step()
            return time.perf_counter() - t0, [s.output_ids for s in sessions]

        run(True), run(False)  # warm-up
        ratios, on_t, off_t, same = [], [], [], True
        for i in range(max(3, args.repeats // 3)):
            first = i % 2 == 0
            a_t, a_ids = run(first)
            b_t, b_ids = run(not first)
            on, off = (a_t, b_t) if first else (b_t, a_t)
            same &= a_ids == b_ids
            on_t.append(on)
            off_t.append(off)
            ratios.append(off / on)
        tokens = k * args.max_new_tokens
        row = {"batched_tok_s": tokens / statistics.median(on_t), "serial_tok_s": tokens / statistics.median(off_t),
               "gain": statistics.median(ratios), "identical_outputs": same}
        out[name] = row
        print(f"  step_many k={k} {name:10s}: {row['batched_tok_s']:7.1f} tok/s batched vs {row['serial_tok_s']:7.1f} "
              f"one by one -> x{row['gain']:.2f} (median of {len(ratios)}; outputs identical: {same})", flush=True)
    return out


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dataset", default="builtin:code")
    p.add_argument("--concurrency", default=None, help="default 1,4,8; with --grid 1,4,16,64")
    p.add_argument("--budgets", default=None, help="DDTree budgets; default 4,8,16,32; with --grid 16,64")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="with --grid, per cell max(this, --waves x concurrency)")
    p.add_argument("--waves", type=int, default=2,
                   help="with --grid, prompts per cell are at least this many times the concurrency: more "
                        "waves weigh the first cohort's prefill and the last one's tail less (default: 2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output-len-ratio", type=float, default=1.0,
                   help="--grid: each request's output length drawn from [max(1, int(N * ratio)), N] for "
                        "--max-new-tokens N, the same on both sides (sglang.bench_serving's "
                        "--random-range-ratio; default 1: every request N tokens, so a closed loop's waves "
                        "end in step)")
    p.add_argument("--context", type=int, default=256,
                   help="context tokens per request in the batching and verify-grid timings")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server")
    p.add_argument("--algorithms", default="ar,dflash,ddtree", help="served algorithms to compare")
    p.add_argument("--random-shape", choices=sorted(SHAPES), help="a random pair of this shape instead of the demo pair")
    p.add_argument("--backend", default="auto", choices=("auto", "fast", "transformers"),
                   help="the servers' --backend, and the in-process engine's in --grid/--verify-grid")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights dtype (auto: bfloat16 on a GPU, float32 on a CPU and for the demo pair)")
    p.add_argument("--context-window", type=int, default=None, help="the servers' --context-window (default theirs)")
    p.add_argument("--kv-pool-gb", type=float, default=None, help="--grid: the server's --kv-pool-gb (default theirs)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="--grid: the server's --stream-interval, tokens per streamed chunk (default theirs, 1)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="--grid: the server's --chunked-prefill-size (default theirs)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="--grid: the servers' --max-prefill-tokens (default theirs, 16384)")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="--grid: the server's --enable-mixed-chunk (a joining prompt's chunks ride in the round)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="--grid: the server's --disable-overlap-schedule, in process too (no round runs ahead "
                        "of the host); run the grid with and without it to measure what the overlap gives")
    p.add_argument("--grid", action="store_true",
                   help="issue 15's table: one batching server and the same loop in process, per concurrency "
                        "and algorithm (replaces the batch / no-batch serving comparison)")
    p.add_argument("--verify-grid", action="store_true",
                   help="time one batched verify forward by batch size (--verify-b) and tokens per row (--verify-q)")
    p.add_argument("--verify-b", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--verify-q", type=int_list, default=[1, 17, 65])
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: --grid starts no server cell past half of what is left "
                        "of 90%% of it once the server is up, no in-process cell past 90%%, and the verify grid "
                        "only within it")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--engine-loops", default="process",
                   help="--grid: one server per value, comma-separated (process, thread, process-wN): where the "
                        "server runs its rounds, and process-wN with N HTTP processes (--tokenizer-worker-num N); "
                        "+wait, +thread or +inline after one sets the engine process's outbox mode "
                        "(DDTREE_OUTBOX), then +rideN the rider row width (DDTREE_RIDE_ROW) and +burstN ride.BURST_ROUNDS "
                        "(DDTREE_BURST_ROUNDS), and +noahead its --disable-overlap-schedule; a value given again "
                        "runs again, as VALUE#2 (A B A B); default process")
    p.add_argument("--trace-turns", metavar="STEM", default=None,
                   help="--grid: the server's --trace-turns, into STEM-LOOP.jsonl per engine loop; each cell "
                        "keeps its turn_range there (bench/turn_trace.py reads both)")
    p.add_argument("--py-spy", metavar="STEM", default=None,
                   help="--grid: py-spy samples each cell's measured part, the server's engine process and "
                        "this process in process, into STEM-LABEL-cC-ALGORITHM{,-gil}.txt (bench/py_spy.py; "
                        "bench/py_spy_summary.py reads them)")
    p.add_argument("--skip-inprocess", action="store_true", help="--grid: skip the in-process side")
    p.add_argument("--again", default="", metavar="V[,V]",
                   help="--grid: run each in-process cell again per variant, as the server's engine process "
                        "runs: thread (driven from a thread of its own), busyN (N processes spinning beside "
                        "it), noahead (no round run ahead of the host); into grid.inprocess_again")
    p.add_argument("--skip-batching", action="store_true", help="skip the batched-verify timings (not --grid's)")
    p.add_argument("--out", default=None, help="JSON results (default: bench_server.json in a temp folder)")
    args = p.parse_args()
    grid_mode = args.grid or args.verify_grid
    args.concurrency = args.concurrency or ("1,4,16,64" if grid_mode else "1,4,8")
    args.budgets = args.budgets or ("16,64" if grid_mode else "4,8,16,32")
    args.concurrency_list, args.budget_list = int_list(args.concurrency), int_list(args.budgets)
    args.engine_loops = [part.strip() for part in args.engine_loops.split(",") if part.strip()]
    args.again = [part.strip() for part in args.again.split(",") if part.strip()]
    if any(not re.fullmatch(r"thread|noahead|busy[1-9][0-9]?", v) for v in args.again):
        p.error(f"--again takes thread, noahead or busyN, got {','.join(args.again)}")
    if not args.engine_loops or any(
            not re.fullmatch(r"(thread|process(-w[1-9][0-9]?)?)(\+(wait|thread|inline))?(\+ride[1-9][0-9]*)?"
                             r"(\+burst[1-9][0-9]*)?(\+noahead)?", loop)
            for loop in args.engine_loops):
        p.error("--engine-loops takes thread, process or process-wN, each with +wait, +thread or +inline or not, "
                f"then +rideN, +burstN and +noahead or not, got {','.join(args.engine_loops) or 'nothing'}")
    settings = [m for loop in args.engine_loops for m in re.finditer(r"\+(ride|burst)([0-9]+)", loop)]
    if settings:
        from ddtree.engine.reference.fast.ride import OVERRIDES

        for m in settings:
            name, most = OVERRIDES[m.group(1)]
            if int(m.group(2)) > most:
                p.error(f"--engine-loops: +{m.group(1)}N takes N from 1 to {most} (fast/ride.py's {name})")
    if args.waves < 1:
        p.error(f"--waves must be at least 1, got {args.waves}")
    if not 0.0 <= args.output_len_ratio <= 1.0:
        p.error(f"--output-len-ratio must be between 0 and 1, got {args.output_len_ratio}")
    clock_start = time.perf_counter()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-server-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, draft, kind = resolve_pair(args, workdir)
    report: dict = {"pair": kind, "model": model, "draft": draft, "cpus": os.cpu_count(),
                    "load_avg_start": os.getloadavg(), "args": {k: v for k, v in vars(args).items()},
                    "environment": environment(args.device)}
    out = Path(args.out) if args.out else workdir / "bench_server.json"

    def save() -> None:
        out.write_text(json.dumps(report, indent=2, default=str))

    print(f"pair: {kind} ({model}, {draft})", flush=True)
    report["build_s"] = round(time.perf_counter() - clock_start, 1)
    best = args.budget_list[0]
    if grid_mode:
        from serving_grid import Clock, run_grid

        def grid_flags(max_running: int) -> list[str]:
            interval = ["--stream-interval", str(args.stream_interval)] if args.stream_interval else []
            if args.chunked_prefill_size:
                interval += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
            if args.enable_mixed_chunk:
                interval.append("--enable-mixed-chunk")
            if args.disable_overlap_schedule:
                interval.append("--disable-overlap-schedule")
            if args.max_prefill_tokens:
                interval += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
            return server_flags(model, draft, max_running, args.threads, batch=True, device=args.device,
                                backend=args.backend, dtype=args.dtype, context_window=args.context_window,
                                kv_pool_gb=args.kv_pool_gb, capture_budgets=tuple(args.budget_list)) + interval

        def grid_server(flags: list[str], log_name: str):
            return start_server(model, draft, 0, workdir / log_name, None, flags=flags)

        run_grid(args, grid_flags, grid_server, report, save, Clock(clock_start, args.time_budget),
                 transformers_verifier)
    elif not args.skip_serving:
        max_running = max(args.concurrency_list)
        procs = []
        try:
            urls = {}
            for mode in ("batch", "no-batch"):
                procs.append(start_server(model, draft, max_running, workdir / f"server-{mode}.log",
                                          args.threads, batch=mode == "batch", device=args.device,
                                          backend=args.backend, dtype=args.dtype,
                                          context_window=args.context_window))
                urls[mode] = procs[-1].url
            report["serving"] = serving_bench(args, urls)
            best = report["serving"]["best_budget"]
        finally:
            for proc in procs:
                proc.stop(60)
    if not args.skip_batching:
        print("batching verification across requests:", flush=True)
        report["batching"] = batching_bench(args, model, draft, best)
    report["load_avg_end"] = os.getloadavg()
    report["total_s"] = round(time.perf_counter() - clock_start, 1)
    save()
    print(f"wrote {out} ({report['total_s']} s in all)")
    return 0


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


if __name__ == "__main__":
    sys.exit(main())
