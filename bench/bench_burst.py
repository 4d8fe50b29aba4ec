"""A turn where joiners prefill beside a running round, on the fast backend's KV pool (issue 15).

    python bench/bench_burst.py --device cuda [--shape 1.7b] [--running 8] [--joiners 4,8]
        [--repeats 9] [--profile] [--out burst.json]

Through the server, such a turn (a "burst": several joiners at once, which prefill before the
round rather than ride in it) cost about 4x a round at c=16 on an H100, which looked like some
3 ms more than its prefill and its round measured alone; measured here, it is their sum
(bench/RESULTS.md: the server's prompts were longer). This reproduces it in process, AR with
random bf16 weights: `running` sessions decode, then `joiners` new ones (prompt lengths from the
grid's dataset) join in one Engine.step_many. It times, A B C D interleaved, medians:
- together: the joiners' prefill and the running round in one call, the round launched before
  the first tokens are read (prefill.ROUND_BEFORE_FIRSTS, now);
- firsts first: the same, the first tokens read before the round is launched (before);
- round: the running round alone;
- prefill: the joiners' prefill alone.
and prints each turn's excess over round + prefill. --profile adds each variant's turns under
torch.profiler: GPU-busy ms against wall, and what the GPU waited for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import _random_target, _sync  # noqa: E402
from bench_prefill import wave_lengths  # noqa: E402
from profile_round import print_idle, profile_calls  # noqa: E402

VARIANTS = ("together", "firsts_first", "round", "prefill")


def turn(engine, running, prompts, variant: str) -> float:
    """One turn of this variant, ms from a synchronised start to a synchronised end; the joiners
    are closed after it, so their slots are free for the next."""
    from ddtree.engine.reference.engine import GenParams, SpecParams
    from ddtree.engine.reference.fast import prefill

    gen, spec = GenParams(max_new_tokens=8, ignore_eos=True), SpecParams("ar")
    new = [engine.start(p, gen, spec) for p in prompts] if variant != "round" else []
    stepped = {"together": running + new, "firsts_first": running + new, "round": running, "prefill": new}[variant]
    prefill.ROUND_BEFORE_FIRSTS = variant != "firsts_first"
    device = engine.target.device.type
    _sync(device)
    t0 = time.perf_counter()
    try:
        engine.step_many(stepped)
        _sync(device)
        return (time.perf_counter() - t0) * 1000
    finally:
        prefill.ROUND_BEFORE_FIRSTS = True
        for s in new:
            s.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="1.7b")
    p.add_argument("--running", type=int, default=8, help="sessions decoding when the joiners come")
    p.add_argument("--joiners", default="4,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dataset", default="builtin:code")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--profile", action="store_true", help="also profile each variant's turns")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.running < 2 or min(args.joiners) < 1:
        p.error("--running needs at least 2 sessions (one alone steps by itself) and --joiners at least 1")

    import torch

    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = _random_target(args.shape, args.device, dtype)
    slots = args.running + max(args.joiners)
    engine = Engine(model, None, backend="fast", max_budget=1, context_window=args.window, slots=1,
                    pool_slots=slots, compile=False)
    engine.warmup(progress=lambda _m: None)
    if not (engine.impl.graphs or engine.impl.batch_static):
        engine.impl.batch_static = True  # a CPU: the graphed round's code, without graphs
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    # Long enough for every turn, each of which adds a token or two to the running sessions.
    gen = GenParams(max_new_tokens=args.window // 2, ignore_eos=True)
    running = [engine.start(torch.randint(1, vocab, (48,), generator=g).tolist(), gen, SpecParams("ar"))
               for _ in range(args.running)]
    for _ in range(3):
        engine.step_many(running)
    print(f"[{args.shape}] {engine.target.device} {dtype}, pool of {engine.impl.pool.slots}, graphs "
          f"{engine.impl.graphs}, {args.running} running, ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for n in args.joiners:
        lengths = wave_lengths(args.dataset, n, seed=n)
        prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for v in VARIANTS:  # first use
            turn(engine, running, prompts, v)
        for _ in range(args.repeats):
            for v in VARIANTS:
                times[v].append(turn(engine, running, prompts, v))
        row = {"joiners": n, "prompt_tokens": sum(lengths), "running": args.running,
               **{f"{v}_ms": round(statistics.median(times[v]), 3) for v in VARIANTS}}
        parts = row["round_ms"] + row["prefill_ms"]
        for v in ("together", "firsts_first"):
            row[f"{v}_over_parts_ms"] = round(row[f"{v}_ms"] - parts, 3)
        row["firsts_first_over_together"] = round(row["firsts_first_ms"] / row["together_ms"], 3)
        print(f"[{args.shape}] {n:3d} joiners ({sum(lengths)} tokens) beside {args.running}: ms a turn: together "
              f"{row['together_ms']:.2f}, firsts first {row['firsts_first_ms']:.2f}, round {row['round_ms']:.2f}, "
              f"prefill {row['prefill_ms']:.2f} | over round + prefill: together {row['together_over_parts_ms']:+.2f}, "
              f"firsts first {row['firsts_first_over_parts_ms']:+.2f} | firsts first / together "
              f"{row['firsts_first_over_together']:.3f}x", flush=True)
        if args.profile:
            row["profile"] = {}
            for v in VARIANTS:
                prof = row["profile"][v] = profile_calls(lambda: turn(engine, running, prompts, v), args.repeats,
                                                         "turn", idle_top=6)
                print(f"    {v:12s} profiled: wall {prof['wall_ms']} ms, GPU busy {prof['gpu_busy_ms']} ms, "
                      f"{prof['kernels']} kernels", flush=True)
                print_idle(prof["idle_before"])
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "device": str(engine.target.device),
                                        "repeats": args.repeats, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
