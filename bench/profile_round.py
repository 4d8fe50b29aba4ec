"""Where a fast-backend round's time goes, kernel by kernel: torch.profiler over unsynchronised
rounds (as the server runs them), after warm-up.

    python bench/profile_round.py --device cuda --pair demo --out prof-demo.json
    python bench/profile_round.py --device cuda --pair 8b --budgets 64 --out prof-8b.json
    python bench/profile_round.py --device cuda --pair 1.7b --batch 16 --budgets 16 --out prof-1.7b-b16.json

For each algorithm it reports the wall time per round, the GPU busy time per round (the union of
kernel intervals, so idle gaps between graph replays show as wall minus busy), the kernels per
round, and the kernels that take the most GPU time. With --batch N, N sessions on a KV pool of N
slots step together (Engine.step_many: the server's batched, graphed rounds) and a round is theirs. "demo" is the trained demo pair in float32;
a bench_engine shape name is a random pair of that shape in bf16 (the target's own 5-layer drafter).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from bench_engine import _sync, round_ms  # noqa: E402
from bench_fast import _hf_random, _random_drafter  # noqa: E402


def load(args):
    import torch

    from ddtree.engine.reference.engine import Engine

    budgets = tuple(args.budgets)
    if args.one_row_attention:  # before any graph is captured: the tiling is chosen at launch
        from ddtree.engine.reference.fast import tree_attention

        tree_attention.BATCHED_PAIRS = sys.maxsize
    pool = args.pool_slots or (args.batch if args.batch > 1 else 0)
    if args.pair == "demo":
        from ddtree.engine.demo import demo_paths

        target_dir, draft_dir = demo_paths()
        engine = Engine.load(target_dir, draft_dir, device=args.device, dtype=torch.float32, backend="fast",
                             max_budget=max(budgets), slots=1, context_window=args.window, pool_slots=pool,
                             graphs=not args.eager, compile=not args.no_compile, attention=args.attention)
        lines = (REPO / "assets" / "prompts" / "code.jsonl").read_text().splitlines()
        prompt = engine.tokenizer.encode(json.loads(lines[0])["prompt"], add_special_tokens=False)
    else:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = _hf_random(args.pair, args.device, dtype)
        drafter = _random_drafter(model).to(args.device, dtype)
        engine = Engine(model, drafter, backend="fast", context_window=args.window, max_budget=max(budgets),
                        slots=1, compile=not args.no_compile, graphs=not args.eager, attention=args.attention,
                        pool_slots=pool)
        prompt = torch.randint(0, model.config.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.target.model.gemv.folds = not args.no_folds
    engine.target.model.gemv.wide_rows = args.wide_rows  # before the warm-up's tunes
    if args.no_rows:
        engine.target.model.gemv.rows = False
        if engine.impl.drafts is not None:
            engine.impl.drafts.linear.kernels = False
    if args.no_fma_rows:
        engine.target.model.gemv.fma_rows = False
        if engine.impl.drafts is not None:
            engine.impl.drafts.linear.fma = False
    engine.warmup(progress=lambda msg: print(f"[{args.pair}] {msg}", flush=True), budgets=budgets)
    return engine, prompt


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals, in the profiler's microseconds / 1000."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000


def idle_gaps(kernels, rounds: int, top: int = 8) -> list[dict]:
    """The GPU's idle time between kernels, put on the kernel that ended each gap (what the GPU
    waited to be given), summed by name: where a round waits on the host. The profiler's own
    host overhead widens every gap, so read the ranking, not the sizes."""
    by_next: dict[str, list[float]] = {}
    end = None
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        s = e.time_range.start
        if end is not None and s > end:
            by_next.setdefault(e.name, []).append(s - end)
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    ranked = sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"before": name[:90], "per_round": round(len(v) / rounds, 1), "us_per_round": round(sum(v) / rounds, 2)}
            for name, v in ranked]


def profile_calls(call, repeats: int, unit: str, top: int = 8, idle_top: int = 5) -> dict:
    """call() `repeats` times under torch.profiler, each returning its wall ms: the median wall,
    GPU-busy ms and kernels per call, the kernels that take the most GPU time (per `unit`) and
    what the GPU waited for (idle_gaps). bench_prefill.py's waves and bench_burst.py's turns."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        walls = [call() for _ in range(repeats)]
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"wall_ms": round(statistics.median(walls), 3),
            "gpu_busy_ms": round(busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / repeats, 3),
            "kernels": round(len(kernels) / repeats, 1),
            "top_kernels": [{"name": name[:90], f"per_{unit}": round(len(v) / repeats, 1),
                             f"us_per_{unit}": round(sum(v) / repeats, 2)} for name, v in ranked],
            "idle_before": idle_gaps(kernels, repeats, top=idle_top)}


def print_idle(idle_before: list[dict]) -> None:
    for k in idle_before:
        print(f"    {k['us_per_round']:9.1f} us idle x{k['per_round']:<5} before {k['before']}", flush=True)


def profile(engine, prompt, spec, rounds: int, device: str, top: int, shapes: bool = False, batch: int = 1,
            one_graph: bool = False) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ddtree.engine.reference.engine import GenParams
    from ddtree.engine.reference.fast import batch as fast_batch
    from ddtree.engine.reference.fast import batch_graph

    sessions = [engine.start(prompt, GenParams(max_new_tokens=100_000, ignore_eos=True), spec) for _ in range(batch)]

    def step() -> None:
        if one_graph:  # the server's batched round, over these sessions however few
            if sessions[0]._bonus is None:
                engine.step_many(sessions)
                fast_batch.append_prompts(engine, sessions)
                return
            kind = batch_graph.eligible(engine, sessions)
            batch_graph.graphed_round(engine, sessions, kind, graphs=engine.impl.graphs)
        elif batch > 1:
            engine.step_many(sessions)
        else:
            sessions[0].step()
    for _ in range(6):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        step()
    _sync(device)
    wall_plain = (time.perf_counter() - t0) * 1000 / rounds
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(rounds):
            step()
        _sync(device)
    for sess in sessions:
        sess.close()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = {"wall_ms_per_round": round(wall_plain, 4),
           "gpu_busy_ms_per_round": round(busy_ms(spans) / rounds, 4) if spans else None,
           "kernels_per_round": round(len(kernels) / rounds, 1),
           "top_kernels": [{"name": name[:90], "per_round": round(len(v) / rounds, 1),
                            "us_per_round": round(sum(v) / rounds, 2)} for name, v in ranked],
           "idle_before": idle_gaps(kernels, rounds)}
    if shapes:  # which op, at which shapes, launched the kernels (only outside CUDA graphs)
        ops = [a for a in prof.key_averages(group_by_input_shape=True) if a.device_time_total > 0]
        ops.sort(key=lambda a: -a.self_device_time_total)
        out["top_ops"] = [{"op": a.key, "shapes": str(a.input_shapes)[:160], "per_round": round(a.count / rounds, 1),
                           "us_per_round": round(a.self_device_time_total / rounds, 2)} for a in ops[:top]]
    return out


def main(argv=None) -> int:
    import torch

    from ddtree.engine.reference.engine import SpecParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--pair", default="demo", help="demo, or a bench_engine shape (8b, 1.7b, tiny)")
    p.add_argument("--budgets", default="16,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: slower, but the profile names each kernel's op and input shapes")
    p.add_argument("--attention", default="auto", help="the fast backend's kernel: auto, triton, matmul, sdpa")
    p.add_argument("--batch", type=int, default=1, help="sessions stepping together on a KV pool (a batched round)")
    p.add_argument("--pool-slots", type=int, default=0,
                   help="the KV pool's slots (default: --batch where it is over 1, else no pool)")
    p.add_argument("--one-graph", action="store_true",
                   help="a round is the batched round's one graph replay (batch_graph.graphed_round) even "
                        "for one session, where Engine.step_many steps a lone session through Session.step(); "
                        "needs a pool")
    p.add_argument("--no-folds", action="store_true",
                   help="norms, silu and residual adds as torch ops around every product (no GEMV folds, no row_ops)")
    p.add_argument("--no-rows", action="store_true",
                   help="cuBLAS for every 2..128-row product: the warm-up's tunes do not try the few-row "
                        "kernel (fast/gemv.py's rows), which they pick by default where it beats cuBLAS")
    p.add_argument("--no-fma-rows", action="store_true",
                   help="the tunes do not try the few-row kernel's elementwise tiles (gemv.FMA_TILES, float32 "
                        "weights: the demo pair), which they try by default")
    p.add_argument("--wide-rows", action="store_true",
                   help="the target's tune tries the few-row kernel's wide tiles too (gemv.WIDE_TILES; bf16/fp16 "
                        "weights, 33+ rows), off by default until measured through a round")
    p.add_argument("--one-row-attention", action="store_true",
                   help="tree attention keeps its one-row tiling at every batch (the rule before its batched one)")
    p.add_argument("--blas", default="engine", choices=("engine", "torch", "cublaslt"),
                   help="cuBLAS as the engine sets it up (a 1 KiB workspace, fast/blas.py); torch's own "
                        "default workspace, where cuBLAS splits the 8B verify's down product (the A/B); or "
                        "torch's cuBLASLt path (preferred_blas_library) with torch's workspace")
    p.add_argument("--split", action="store_true",
                   help="after the profiles, each DDTree budget's round split into draft / tree / verify / "
                        "commit, synchronised (bench_engine.round_ms), 20 rounds, no draft ahead")
    p.add_argument("--draft-ahead", default="on", choices=("on", "off", "both"),
                   help="a lone session's next draft step queued before the host reads its walk (FastPath."
                        "draft_ahead), and a lone AR session's next step before its token is read (fast/"
                        "step_ahead.py); both: each row twice, on then off (rows named ...-noahead)")
    p.add_argument("--repeats", type=int, default=1,
                   help="profile the whole list of rows this many times, in turn (rows after the first "
                        "pass named ...-r2, ...-r3), so a difference can be told from drift")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.blas != "engine":
        from ddtree.engine.reference.fast import blas

        blas.wanted = False
        if args.blas == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
    with torch.inference_mode():
        engine, prompt = load(args)
        base = [("ar", SpecParams("ar")), ("dflash", SpecParams("dflash"))]
        base += [(f"ddtree-{b}", SpecParams("ddtree", b)) for b in args.budgets]
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.draft_ahead]
        specs = []
        for r in range(1, args.repeats + 1):
            tag = f"-r{r}" if r > 1 else ""
            for name, spec in base:
                for ahead in modes:
                    specs.append((name + ("" if ahead or args.draft_ahead == "off" else "-noahead") + tag, spec, ahead))
        result = {"pair": args.pair, "device": args.device, "attention": engine.attention, "batch": args.batch,
                  "pool_slots": args.pool_slots, "one_graph": args.one_graph, "folds": not args.no_folds,
                  "rows_kernel": not args.no_rows, "fma_rows": not args.no_fma_rows, "wide_rows": args.wide_rows, "one_row_attention": args.one_row_attention,
                  "blas": args.blas, "draft_ahead": args.draft_ahead, "rows": {}}
        gemv, drafts = engine.target.model.gemv, engine.impl.drafts
        result["few_row_tune"] = {"target": {str(k): v for k, v in sorted(gemv.measured_rows.items())},
                                  "target_picked": {str(k): str(v) for k, v in sorted(gemv.picked_rows.items())},
                                  "drafter": {str(k): v for k, v in sorted(drafts.linear.measured.items())} if drafts else {},
                                  "drafter_kernel": sorted(str(k) for k in drafts.linear.kernel) if drafts else []}
        print(f"[{args.pair}] few-row kernel: target {len(gemv.picked_rows)} of {len(gemv.measured_rows)} (rows, shape), "
              f"drafter {len(drafts.linear.kernel) if drafts else 0} of {len(drafts.linear.measured) if drafts else 0}",
              flush=True)
        for name, spec, ahead in specs:
            engine.impl.draft_ahead = ahead
            engine.impl.round_ahead = ahead  # and a lone AR session's next step (fast/step_ahead.py)
            result["rows"][name] = row = profile(engine, prompt, spec, args.rounds, args.device, args.top,
                                                 shapes=args.eager, batch=args.batch, one_graph=args.one_graph)
            print(f"[{args.pair} {engine.attention}] {name}: wall {row['wall_ms_per_round']} ms/round, GPU busy "
                  f"{row['gpu_busy_ms_per_round']} ms, {row['kernels_per_round']} kernels/round", flush=True)
            for k in row["top_kernels"][:8]:
                print(f"    {k['us_per_round']:9.2f} us  x{k['per_round']:<6} {k['name']}", flush=True)
            for k in row["idle_before"][:5]:
                print(f"    {k['us_per_round']:9.2f} us idle x{k['per_round']:<6} before {k['before']}", flush=True)
            for k in row.get("top_ops", [])[:12]:
                print(f"    {k['us_per_round']:9.2f} us  x{k['per_round']:<6} {k['op']} {k['shapes']}", flush=True)
        if args.split:
            result["split"] = {str(b): row for b, row in round_ms(engine, prompt, args.budgets, 20).items()}
            for b, row in result["split"].items():
                print(f"[{args.pair}] ddtree-{b} split, synchronised ms: draft {row['draft']} tree {row['tree']} "
                      f"verify {row['verify']} commit {row['commit']} round {row['round']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "bench"))
    sys.exit(main())
