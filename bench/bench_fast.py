"""The fast backend against what a user would pick instead, side by side in one run on one device.

    python bench/bench_fast.py --device cuda --shapes 8b,1.7b --out fast.json     # on a GPU
    python bench/bench_fast.py --device cpu --shapes tiny --demo-prompts 2        # a smoke run

For each random-weight shape (real Qwen3 layer shapes, bf16 on CUDA), at a 1024-token context:
- the weight-streaming floor: streamed weight bytes (every matrix but the embedding table) over
  the device-to-device copy bandwidth measured in this run;
- transformers `generate` with a static cache, and with its default dynamic cache (eager);
- our transformers path and our fast path (CUDA graphs on CUDA), AR decoding;
ms per token as (time for N new tokens - time for 1) / (N - 1), so the prefill cancels out.
Then on the fast path: verify ms at 1/16/64/128/256/512 nodes, and DDTree rounds at budgets
16..512 split into draft / tree / verify / commit (a 5-layer random drafter, block 16; random
weights accept almost nothing, so these are costs, not speedups). "commit" is everything after
the verify forward: the choice at each node, the walk+commit graph (walk, K/V row move, the one
host sync) and the bookkeeping. The fast path's window is sized to the run, so its attention
reads a KV bucket just above the context; with --serving-window (default 8192, the server's
FAST_CONTEXT) AR is measured once more in that window, where without KV buckets every step
would read all 8k+ rows.
For the demo pair (float32, its trained acceptance): tok/s and tau for AR, DFlash and DDTree
budgets on both backends, every output checked against AR.
Medians over repeats after warm-up, the device synchronised around every timed region.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The shapes and timing helpers are bench_engine's (this folder is on sys.path when run as a script).
from bench_engine import SHAPES, _median_ms, _sync, host_work, round_ms  # noqa: E402


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    import torch

    n = (1 << 30) if device.startswith("cuda") else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a), device, 20)
    return 2 * n / (ms / 1000)


def _hf_random(shape: str, device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, inter, layers, heads, kv, head_dim, vocab = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=head_dim, max_position_embeddings=40960, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model.eval().requires_grad_(False)


def _random_drafter(model, layers: int = 5, block_size: int = 16):
    from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids

    cfg = model.config
    n = cfg.num_hidden_layers
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        vocab_size=cfg.vocab_size, num_target_layers=n,
                        target_layer_ids=default_target_layer_ids(n, layers),
                        mask_token_id=cfg.vocab_size - 1, block_size=block_size)
    return DFlashDrafter(dcfg)


def streamed_bytes(model) -> int:
    """Weight bytes one decode step reads: every parameter but the embedding table (one row)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def _per_token_ms(run, device: str, new: int, repeats: int) -> float:
    """(time for `new` tokens - time for 1) / (new - 1): decode cost with the prefill cancelled."""
    one = _median_ms(lambda: run(1), device, repeats, warmup=1)
    full = _median_ms(lambda: run(new), device, repeats, warmup=1)
    return (full - one) / (new - 1)


def hf_generate_ms(model, prompt, device: str, new: int, repeats: int, static: bool) -> float:
    import torch

    ids = torch.tensor([prompt], device=device)
    extra = {"cache_implementation": "static"} if static else {}

    def run(n):
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **extra)
    return _per_token_ms(run, device, new, repeats)


def engine_ar_ms(engine, prompt, device: str, new: int, repeats: int) -> float:
    from ddtree.engine.reference.engine import GenParams, SpecParams

    return _per_token_ms(lambda n: engine.generate(prompt, GenParams(max_new_tokens=n, ignore_eos=True),
                                                   SpecParams("ar")), device, new, repeats)


def verify_ms(engine, prompt, device: str, nodes: list[int], repeats: int) -> dict:
    """One target forward of n tree nodes after the context (the cache is cropped back after each)."""
    import torch

    from ddtree.engine.reference.tree import build_tree_device

    target = engine.target
    vocab = target.vocab_size
    out = {}
    with torch.inference_mode():
        cache, _ = engine.impl.new_caches(False)
        ctx = torch.tensor(prompt, device=device)
        target.forward(ctx, torch.arange(len(prompt), device=device), cache)
        start = len(prompt)
        for n in nodes:
            if n == 1:
                ids, pos, mask = ctx[:1], torch.tensor([start], device=device), None
            else:
                lp = torch.log_softmax(torch.randn(15, vocab, device=device), -1)
                tree = build_tree_device(1, lp, n - 1)
                ids, pos, mask = tree.tokens, tree.depths + start, target.tree_mask(tree, start)

            def once():
                target.forward(ids, pos, cache, mask, features=True)
                cache.crop(start)
            out[n] = round(_median_ms(once, device, repeats), 3)
        engine.impl.release(cache, None)
    return out


def bench_shape(shape: str, args) -> dict:
    import torch

    from ddtree.engine.reference.engine import Engine, SpecParams

    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = _hf_random(shape, device, dtype)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(1)).tolist()
    row = {"dtype": str(dtype).removeprefix("torch."), "streamed_gb": streamed_bytes(model) / 1e9}
    row["floor_ms"] = streamed_bytes(model) / args.bandwidth * 1000
    print(f"[{shape}] floor {row['floor_ms']:.3f} ms/token", flush=True)
    row["hf_static_ms"] = hf_generate_ms(model, prompt, device, args.new_tokens, args.repeats, static=True)
    print(f"[{shape}] transformers generate static cache {row['hf_static_ms']:.3f}", flush=True)
    row["hf_eager_ms"] = hf_generate_ms(model, prompt, device, args.slow_tokens, 1, static=False)
    print(f"[{shape}] transformers generate eager {row['hf_eager_ms']:.3f}", flush=True)
    drafter = _random_drafter(model).to(device, dtype)
    slow = Engine(model, drafter, backend="transformers")
    row["ours_transformers_ms"] = engine_ar_ms(slow, prompt, device, args.slow_tokens, 1)
    print(f"[{shape}] ours, transformers path {row['ours_transformers_ms']:.3f}", flush=True)
    del slow
    window = args.context + args.new_tokens + max(args.budgets + args.nodes) + 1
    # (key, compiled, the GEMV and rope_write kernels, the GEMV's folds): the last is the engine
    # measured below.
    variants = [("ours_fast_ms", args.compile, True, True)]
    if args.compile:
        variants.insert(0, ("ours_fast_graphs_only_ms", False, True, True))
        if args.plain_ops_too:
            variants.insert(1, ("ours_fast_plain_ops_ms", True, False, False))
        if args.folds_off_too:
            variants.insert(-1, ("ours_fast_no_folds_ms", True, True, False))
    for key, compiled, kernels, folds in variants:
        torch._dynamo.reset()  # compiled code of another shape must not count against this one
        fast = Engine(model, drafter, backend="fast", context_window=window,
                      max_budget=max(args.budgets + args.nodes), slots=1, compile=compiled,
                      attention=args.attention)
        fast.target.model.use_kernels(kernels)
        fast.target.model.gemv.folds = folds
        t0 = time.perf_counter()
        fast.warmup(progress=lambda msg: print(f"[{shape}] {msg}", flush=True), budgets=tuple(args.budgets))
        row[key.replace("_ms", "_warmup_s")] = round(time.perf_counter() - t0, 2)
        row[key] = engine_ar_ms(fast, prompt, device, args.new_tokens, args.repeats)
        row["compile_error"] = fast.impl.compile_error
        print(f"[{shape}] ours, fast path {row[key]:.3f} (graphs: {fast.graphs}, compiled layers: "
              f"{fast.target.compiled}, GEMV and rope_write kernels: {kernels}, GEMV folds: {folds})", flush=True)
        if key != "ours_fast_ms":
            del fast
            torch.cuda.empty_cache() if device.startswith("cuda") else None
    gemv = fast.target.model.gemv
    row["gemv_us"] = {f"{n}x{k}": times for (n, k), times in sorted(gemv.measured.items())}
    row["gemv_picked"] = {f"{n}x{k}": str(config) for (n, k), config in sorted(gemv.picked.items())}
    print(f"[{shape}] one-row products, us each (F.linear, or the torch ops a fold replaces, against the GEMV tilings): {json.dumps(row['gemv_us'])}",
          flush=True)
    row["graphs"] = fast.graphs
    row["compiled"] = fast.target.compiled
    row["attention"] = fast.attention
    row.update(_graph_counts(fast))
    row["verify_ms"] = verify_ms(fast, prompt, device, args.nodes, args.repeats * 4)
    print(f"[{shape}] verify ms by nodes {row['verify_ms']}", flush=True)
    row["round_ms"] = round_ms(fast, prompt, args.budgets, args.repeats * 4)
    print(f"[{shape}] ddtree rounds {json.dumps(row['round_ms'])}", flush=True)
    row["host_work_per_round"] = spec_host_work(fast, prompt, [("ar", SpecParams("ar")),
                                                              ("dflash", SpecParams("dflash"))])
    print(f"[{shape}] host work per round (ops outside graphs, syncs, replays) "
          f"{json.dumps(row['host_work_per_round'])}", flush=True)
    one = row["verify_ms"].get(1)
    row["targets"] = {
        "ar_le_1.3x_floor": row["ours_fast_ms"] <= 1.3 * row["floor_ms"],
        "ar_faster_than_hf_static": row["ours_fast_ms"] < row["hf_static_ms"],
        "verify64_le_1.2x_step": bool(one and row["verify_ms"].get(64, 1e9) <= 1.2 * one),
        "tree_walk_commit_le_5pct_at_256": bool(256 in row["round_ms"]
                                                and row["round_ms"][256]["tree_walk_commit_share"] <= 0.05),
        "round64_le_1.6x_ar": bool(64 in row["round_ms"] and row["round_ms"][64]["round"] <= 1.6 * row["ours_fast_ms"]),
    }
    del fast
    if args.serving_window:
        _cuda_empty(device)
        big = Engine(model, drafter, backend="fast", context_window=args.serving_window,
                     max_budget=max(args.budgets + args.nodes), slots=1, compile=args.compile,
                     attention=args.attention)
        t0 = time.perf_counter()
        big.warmup(progress=lambda msg: print(f"[{shape} window {args.serving_window}] {msg}", flush=True))
        row["serving_window"] = args.serving_window
        row["serving_window_warmup_s"] = round(time.perf_counter() - t0, 2)
        row["ours_fast_serving_window_ms"] = engine_ar_ms(big, prompt, device, args.new_tokens, args.repeats)
        row["serving_window_graphs"] = _graph_counts(big)
        print(f"[{shape}] ours, fast path in a {args.serving_window}-token window "
              f"{row['ours_fast_serving_window_ms']:.3f} ms/token", flush=True)
        del big
    del drafter, model
    _cuda_empty(device)
    return row


def spec_host_work(engine, prompt, specs) -> dict:
    """name -> a round's host work (bench_engine.host_work) for each (name, spec), after warm rounds."""
    from ddtree.engine.reference.engine import GenParams

    out = {}
    for name, spec in specs:
        sess = engine.start(prompt, GenParams(max_new_tokens=100_000, ignore_eos=True), spec)
        for _ in range(4):
            sess.step()
        out[name] = host_work(sess)
        sess.close()
    return out


def _cuda_empty(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _graph_counts(engine) -> dict:
    """What one slot captured: verify graphs, their KV spans, walk graphs, the slot's rows."""
    slots = getattr(engine.impl, "_slots", [])
    if not slots:
        return {"graphs_per_slot": 0}
    cache = slots[0][0]
    return {"graphs_per_slot": len(cache.graphs), "kv_spans": sorted({kv for _, kv in cache.graphs}),
            "walk_graphs_per_slot": sum(1 for io in cache.walks.values() if io.graph is not None),
            "slot_rows": cache.rows}


DEMO_SUFFIXES = {"transformers": ("", "bf16"), "fast": ("", "cublas", "nofma", "bf16", "cublas-bf16")}


def parse_demo_backend(label: str) -> tuple[str, str]:
    """A --demo-backends label -> (backend, suffix): a backend, then "-cublas" for cuBLAS alone
    (fast only: no few-row kernel) or "-nofma" (the few-row kernel without its elementwise tiles),
    then "-bf16" for bfloat16. Anything else is an error, so a
    typo never runs the wrong side of an A/B."""
    backend, _, rest = label.partition("-")
    if rest not in DEMO_SUFFIXES.get(backend, ()):
        known = ", ".join(f"{b}-{s}" if s else b for b, suffixes in DEMO_SUFFIXES.items() for s in suffixes)
        raise argparse.ArgumentTypeError(f"unknown demo backend {label!r}; one of {known}")
    return backend, rest


def bench_demo(args) -> dict:
    """The demo pair on each backend, float32 unless the label says bf16: tok/s (median over prompts)
    and tau, vs AR."""
    import torch

    from ddtree.engine.demo import demo_paths
    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    target_dir, draft_dir = demo_paths()
    specs = [("ar", SpecParams("ar")), ("dflash", SpecParams("dflash"))]
    specs += [(f"ddtree-{b}", SpecParams("ddtree", b)) for b in args.demo_budgets]
    gen = GenParams(max_new_tokens=args.demo_new_tokens, ignore_eos=True)
    out = {}
    for label in args.demo_backends:
        backend, rest = parse_demo_backend(label)
        dtype = torch.bfloat16 if rest.endswith("bf16") else torch.float32
        torch._dynamo.reset()
        # One session at a time here: one slot's graphs, in a window the prompts fit.
        engine = Engine.load(target_dir, draft_dir, device=args.device, dtype=dtype, backend=backend,
                             max_budget=max(args.demo_budgets), slots=1, context_window=args.demo_window,
                             attention=args.attention)
        if rest.startswith("cublas"):  # before the tunes
            engine.target.model.gemv.rows = False
            if engine.impl.drafts is not None:
                engine.impl.drafts.linear.kernels = False
        if rest == "nofma":
            engine.target.model.gemv.fma_rows = False
            if engine.impl.drafts is not None:
                engine.impl.drafts.linear.fma = False
        engine.warmup(progress=lambda msg, label=label: print(f"[demo {label}] {msg}", flush=True),
                      budgets=tuple(args.demo_budgets))
        lines = (REPO / "assets" / "prompts" / "code.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()][:args.demo_prompts + 1]
        prompts = [engine.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
        for _, spec in specs:  # warm-up on a prompt that is not measured
            engine.generate(prompts[-1], gen, spec)
        prompts = prompts[:-1]
        rate = {name: [] for name, _ in specs}
        tau = {name: [] for name, _ in specs}
        mismatches = {name: 0 for name, _ in specs}
        for i, prompt in enumerate(prompts):
            ar_ids = None
            order = specs[i % len(specs):] + specs[:i % len(specs)]  # rotate, so drift hits all alike
            results = {}
            for name, spec in order:
                _sync(args.device)
                r = engine.generate(prompt, gen, spec)
                results[name] = r
                rate[name].append(len(r.output_ids) / r.elapsed_s)
                tau[name].append(r.tau_mean)
            ar_ids = results["ar"].output_ids
            for name, r in results.items():
                mismatches[name] += r.output_ids != ar_ids
        ar = statistics.median(rate["ar"])
        rows = {name: {"tok_s": round(statistics.median(v), 1), "x_ar": round(statistics.median(v) / ar, 3),
                       "tau": round(statistics.mean(tau[name]), 3), "prompts_differing_from_ar": mismatches[name]}
                for name, v in rate.items()}
        best = max((n for n in rows if n.startswith("ddtree")), key=lambda n: rows[n]["tok_s"])
        split = round_ms(engine, prompts[0], args.demo_budgets, args.repeats * 4) if backend == "fast" else {}
        out[label] = {"rows": rows, "best_ddtree": best, "round_ms": split, "attention": engine.attention,
                      "dtype": str(dtype).removeprefix("torch."),
                        "ddtree_x_ar": rows[best]["x_ar"],
                        "ddtree_x_dflash": round(rows[best]["tok_s"] / rows["dflash"]["tok_s"], 3),
                        "graphs": engine.graphs,
                        "host_work_per_round": spec_host_work(engine, prompts[0], specs)}
        print(f"[demo {label}] " + json.dumps(out[label]), flush=True)
        del engine
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="8b,1.7b", type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--nodes", default="1,16,64,128,256,512", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--budgets", default="16,32,64,128,256,512", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slow-tokens", type=int, default=32,
                   help="new tokens for the two slow eager paths (their per-token slope)")
    p.add_argument("--demo-prompts", type=int, default=12, help="0 skips the demo pair")
    p.add_argument("--demo-new-tokens", type=int, default=96)
    p.add_argument("--demo-budgets", default="8,16,32,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--demo-window", type=int, default=1024, help="the demo engine's context window")
    p.add_argument("--demo-backends", default="transformers,fast",
                   type=lambda s: [x for x in s.split(",") if x and parse_demo_backend(x)],
                   help="transformers, fast, fast-cublas (fast without the few-row kernel), fast-nofma (without its "
                        "elementwise float32 tiles); a -bf16 "
                        "suffix runs it in bfloat16, else float32 (fast-bf16, fast-cublas-bf16)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="measure the fast path with CUDA graphs only (by default also with torch.compile'd layers)")
    p.add_argument("--serving-window", type=int, default=8192,
                   help="also measure fast AR in a window this long (the server's default cap); 0 skips it")
    p.add_argument("--plain-ops-too", action="store_true",
                   help="also measure the compiled fast path without the GEMV and rope_write kernels "
                        "(every product on cuBLAS; norms, RoPE and cache writes as torch.compile fuses them)")
    p.add_argument("--folds-off-too", action="store_true",
                   help="also measure the compiled fast path with the kernels but the input norm, activation and "
                        "residual adds as torch ops around the GEMV instead of folded into it")
    p.add_argument("--attention", default="auto", help="the fast backend's attention kernel: auto, triton, matmul, sdpa")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    from ddtree.engine.reference.fast import blas

    torch.manual_seed(0)
    result = {"device": args.device, "context": args.context, "new_tokens": args.new_tokens}
    if args.device.startswith("cuda"):
        # cuBLAS reads its workspace once, at its first use: the engine's setting, asked for before
        # anything runs, so the fast path here is set up as in a server. The transformers
        # baselines share the process, and so the setting.
        result["cublas_workspace"] = blas.ask_small_workspace()
        result["gpu"] = torch.cuda.get_device_name()
    import transformers

    result["torch"], result["transformers"] = torch.__version__, transformers.__version__
    args.bandwidth = copy_bandwidth(args.device)
    result["copy_tb_s"] = round(args.bandwidth / 1e12, 3)
    print(f"copy bandwidth {result['copy_tb_s']} TB/s", flush=True)
    result["shapes"] = {}

    def save():
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    for shape in args.shapes:
        result["shapes"][shape] = bench_shape(shape, args)
        save()
    if args.demo_prompts:
        result["demo"] = bench_demo(args)
        save()
    print()
    print("ms/token     floor   hf-static  hf-eager  ours-tf  fast-graphs  +compile,plain-ops  +compile")
    for shape, r in result["shapes"].items():
        print(f"{shape:8s} {r['floor_ms']:8.3f} {r['hf_static_ms']:10.3f} {r['hf_eager_ms']:9.3f} "
              f"{r['ours_transformers_ms']:8.3f} {r.get('ours_fast_graphs_only_ms', float('nan')):12.3f} "
              f"{r.get('ours_fast_plain_ops_ms', float('nan')):18.3f} {r['ours_fast_ms']:9.3f}   targets {r['targets']}")
        if "ours_fast_no_folds_ms" in r:
            print(f"{'':8s} +compile, kernels without the GEMV folds: {r['ours_fast_no_folds_ms']:.3f}")
        if "ours_fast_serving_window_ms" in r:
            print(f"{'':8s} fast in a {r['serving_window']}-token window: {r['ours_fast_serving_window_ms']:.3f} ms/token "
                  f"(KV spans {r['serving_window_graphs'].get('kv_spans')})")
    if "demo" in result:
        d = result["demo"][args.demo_backends[-1]]
        print(f"demo {args.demo_backends[-1]}: best {d['best_ddtree']} {d['ddtree_x_ar']}x AR, {d['ddtree_x_dflash']}x DFlash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
