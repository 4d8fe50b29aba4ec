"""A wave of joiners' prefill on the fast backend's KV pool, four plans side by side (issue 15).

    python bench/bench_prefill.py --device cuda [--shape 1.7b] [--waves 1,4,16,64] [--repeats 7]
        [--dataset builtin:code] [--profile] [--out prefill.json]

When a closed loop's requests finish together, the next wave's prompts prefill in one turn, and at
concurrency 16 that turn was about 15% of AR's cell (bench/RESULTS.md). For waves of n prompts from
the grid's dataset (token counts from the demo tokenizer, no chat template), random bf16 weights,
it times prefill_many, A B C D A B C D, medians:
- packed: the prompts end to end in one forward (fast/prefill.py now);
- unfused: the same, with each layer's q/k norms, RoPE and K/V writes as separate ops instead of
  rope_write's one kernel (where it runs: the triton attention kernel's devices);
- pow2: each prompt padded to its power of two (at least 16) and those of one padded length in one
  forward, in power-of-two counts: the tokens and forwards of the plan before packing;
- alone: one forward a prompt.
Each is graph replays where the device has the varlen kernel, else eager. Prints ms a wave, the
tokens each plan computes, and packed's gain. --profile adds each wave's packed prefill under
torch.profiler: GPU-busy ms against wall, kernels, the top kernels, and what the GPU waited for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import _random_target, _sync  # noqa: E402
from profile_round import print_idle, profile_calls  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def wave_lengths(dataset: str, n: int, seed: int) -> list[int]:
    from transformers import AutoTokenizer

    from ddtree.engine.serving.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "target")
    return [len(tok(p.text)["input_ids"]) for p in load_prompts(dataset, n, seed=seed)]


def pow2_groups(lengths: list[int]) -> list[list[int]]:
    """The plan before packing: indices grouped by padded length, each group split into powers of two."""
    by: dict[int, list[int]] = {}
    for j, n in enumerate(lengths):
        by.setdefault(max(16, 1 << (n - 1).bit_length()), []).append(j)
    groups = []
    for members in by.values():
        while members:
            b = 1 << (len(members).bit_length() - 1)
            groups.append(members[:b])
            members = members[b:]
    return groups


_UNFUSED_GRAPHS: dict[int, dict] = {}


@contextlib.contextmanager
def unfused(engine):
    """The layers without rope_write, with graphs of their own (a graph keeps the kernels it
    was captured with)."""
    stage = engine.impl.prefill_stage()
    layers = [layer.self_attn for layer in engine.target.model.model.layers]
    saved = stage.graphs
    stage.graphs = _UNFUSED_GRAPHS.setdefault(id(stage), {})
    for attn in layers:
        attn.fused_writes = False
    try:
        yield
    finally:
        stage.graphs = saved
        for attn in layers:
            attn.fused_writes = True


def time_plan(engine, prompts: list[list[int]], plan: str) -> float:
    if plan == "unfused":
        with unfused(engine):
            return time_plan(engine, prompts, "packed")
    from ddtree.engine.reference.engine import GenParams, SpecParams
    from ddtree.engine.reference.fast.prefill import prefill_many

    gen, spec = GenParams(max_new_tokens=4), SpecParams("ar")
    if plan == "packed":
        calls = [prompts]
    elif plan == "alone":
        calls = [[p] for p in prompts]
    else:
        calls = [[p + [0] * (max(16, 1 << (len(p) - 1).bit_length()) - len(p)) for p in (prompts[j] for j in g)]
                 for g in pow2_groups([len(p) for p in prompts])]
    sessions = [[engine.start(p, gen, spec) for p in call] for call in calls]
    device = engine.target.device.type
    _sync(device)
    t0 = time.perf_counter()
    for call in sessions:
        prefill_many(engine, call, graphs=engine.impl.graphs)
    _sync(device)
    took = (time.perf_counter() - t0) * 1000
    for call in sessions:
        for s in call:
            s.close()
    return took


def profile_packed(engine, prompts: list[list[int]], repeats: int, top: int = 8) -> dict:
    return profile_calls(lambda: time_plan(engine, prompts, "packed"), repeats, "wave", top=top)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="1.7b")
    p.add_argument("--waves", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dataset", default="builtin:code")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--profile", action="store_true", help="also profile each wave's packed prefill")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch

    from ddtree.engine.reference.engine import Engine
    from ddtree.engine.reference.fast.prefill import plan_packs

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = _random_target(args.shape, args.device, dtype)
    engine = Engine(model, None, backend="fast", max_budget=1, context_window=args.window, slots=1,
                    pool_slots=max(args.waves), compile=False)
    engine.warmup(progress=lambda _m: None)
    stage = engine.impl.prefill_stage()
    print(f"[{args.shape}] {engine.target.device} {dtype}, pool of {engine.impl.pool.slots}, graphs {engine.impl.graphs}, "
          f"varlen kernel {stage.packed_kernel}, ready in {time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    for n in args.waves:
        lengths = wave_lengths(args.dataset, n, seed=n)
        g = torch.Generator().manual_seed(n)
        prompts = [torch.randint(1, 150000 if args.shape != "tiny" else 4000, (k,), generator=g).tolist()
                   for k in lengths]
        tokens = {"packed": sum(next(s for s in stage.sizes if s >= sum(lengths[j] for j in pack))
                                for pack in plan_packs(lengths, stage.limit)),
                  "pow2": sum(max(16, 1 << (k - 1).bit_length()) for k in lengths),
                  "alone": sum(next(s for s in stage.sizes if s >= k) for k in lengths)}
        tokens["unfused"] = tokens["packed"]
        plans = ("packed", "unfused", "pow2", "alone")
        times: dict[str, list[float]] = {plan: [] for plan in plans}
        for plan in plans:  # first use: captures, allocations
            time_plan(engine, prompts, plan)
        for _ in range(args.repeats):
            for plan in plans:
                times[plan].append(time_plan(engine, prompts, plan))
        row = {"wave": n, "prompt_tokens": sum(lengths),
               **{f"{plan}_ms": round(statistics.median(times[plan]), 3) for plan in plans},
               **{f"{plan}_tokens": tokens[plan] for plan in plans}}
        row["pow2_over_packed"] = round(row["pow2_ms"] / row["packed_ms"], 3)
        row["unfused_over_packed"] = round(row["unfused_ms"] / row["packed_ms"], 3)
        results.append(row)
        print(f"[{args.shape}] wave {n:3d}: {sum(lengths)} prompt tokens | ms a wave: packed {row['packed_ms']:.2f} "
              f"({tokens['packed']} tokens), unfused {row['unfused_ms']:.2f}, pow2 {row['pow2_ms']:.2f} "
              f"({tokens['pow2']}), alone {row['alone_ms']:.2f} ({tokens['alone']}) | pow2/packed "
              f"{row['pow2_over_packed']:.2f}x, unfused/packed {row['unfused_over_packed']:.3f}x", flush=True)
        if args.profile:
            row["profile"] = prof = profile_packed(engine, prompts, args.repeats)
            print(f"[{args.shape}] wave {n:3d} packed, profiled: wall {prof['wall_ms']} ms, GPU busy "
                  f"{prof['gpu_busy_ms']} ms, {prof['kernels']} kernels", flush=True)
            for k in prof["top_kernels"]:
                print(f"    {k['us_per_wave']:9.1f} us x{k['per_wave']:<5} {k['name']}", flush=True)
            print_idle(prof["idle_before"])
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "device": str(engine.target.device),
                                        "repeats": args.repeats, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
