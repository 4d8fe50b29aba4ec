"""The demo pair on this machine: AR vs DFlash vs DDTree, side by side, on held-out prompts.

    .venv/bin/python bench/bench_demo.py [--num-prompts 24] [--budgets 4,8,16,32,64,128]
        [--max-new-tokens 128] [--threads 2] [--backends auto|transformers,fast] [--json OUT.json]

Every prompt is decoded by every configuration in turn (the fastest of --repeats runs counts) (the order rotates from prompt to prompt,
so drift in machine load spreads evenly), after a warm-up that runs each configuration once. At
temperature 0 every configuration must produce exactly AR's tokens (speculative decoding is
lossless); the script counts mismatches. Reported per configuration: tau (mean accepted tokens
per verify round, bonus included, over all rounds), the median over prompts of tokens/s, and the
ratio of that median to AR's, and the median over prompts of the per-prompt ratio to AR (paired,
so load that changes between prompts cancels).

--backends transformers,fast loads the pair once per backend and runs every configuration of
each in the same rotation, so the two are compared prompt by prompt under the same load; each
backend's configurations are checked against the first backend's AR tokens, and each row's
"vs tf" is its paired median ratio to the same configuration on the transformers backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def label(backends: list[str], backend: str, config: str) -> str:
    """A configuration's name: "ddtree-8", or "fast:ddtree-8" when several backends run."""
    return config if len(backends) == 1 else f"{backend}:{config}"


def configs(budgets: list[int], backends: list[str]) -> list[tuple[str, str, str, str, int]]:
    """(name, backend, config, algorithm, budget) for every backend and configuration."""
    algos = [("ar", "ar", 0), ("dflash", "dflash", 0)] + [(f"ddtree-{b}", "ddtree", b) for b in budgets]
    return [(label(backends, backend, config), backend, config, algorithm, budget)
            for backend in backends for config, algorithm, budget in algos]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target dir (default: the shipped demo target)")
    ap.add_argument("--draft", default=None, help="drafter dir (default: the shipped demo drafter)")
    ap.add_argument("--prompts", default=str(REPO / "assets" / "prompts" / "code.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--offset", type=int, default=0, help="skip this many prompts first")
    ap.add_argument("--budgets", default="4,8,16,32,64,128")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="prompts run by every configuration before timing")
    ap.add_argument("--repeats", type=int, default=2, help="runs per prompt and configuration; the fastest counts")
    ap.add_argument("--backends", default="auto",
                    help="comma-separated: auto (the engine's choice), transformers, fast; several run side by side")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if not backends or any(b not in ("auto", "transformers", "fast") for b in backends) or len(set(backends)) < len(backends):
        ap.error(f"--backends: distinct names from auto, transformers, fast (got {args.backends!r})")

    import torch

    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model is None or args.draft is None:
        from ddtree.engine.demo import demo_paths

        target_dir, draft_dir = demo_paths()
        args.model = args.model or str(target_dir)
        args.draft = args.draft or str(draft_dir)
    engines = {b: Engine.load(args.model, args.draft, device="cpu", backend=b) for b in backends}
    engine = next(iter(engines.values()))
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    rows = rows[args.offset:args.offset + args.warmup + args.num_prompts]
    prompts = [engine.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    cfgs = configs(budgets, backends)
    ar_name = cfgs[0][0]  # the first backend's AR: every output is checked against it
    gen = GenParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    print(f"torch {torch.__version__}, {args.threads} threads; target {args.model}; drafter {args.draft}; "
          f"{len(prompts) - args.warmup} prompts (+{args.warmup} warm-up) from {args.prompts}, "
          f"max_new_tokens {args.max_new_tokens}; backends "
          + ", ".join(f"{b}={e.backend} ({e.backend_reason})" for b, e in engines.items()), flush=True)

    results: dict[str, dict] = {name: {"tok_s": [], "tokens": 0, "rounds": 0, "accepted": 0, "seconds": 0.0,
                                       "mismatch": 0, "timings": {}, "paired": [], "vs_tf": []}
                               for name, *_ in cfgs}
    t_start = time.perf_counter()
    for i, ids in enumerate(prompts):
        warm = i < args.warmup
        order = cfgs[i % len(cfgs):] + cfgs[:i % len(cfgs)]
        ref = None
        outs = {}
        for name, backend, _, algorithm, budget in order:
            # The fastest of a few runs: other processes on a shared machine only ever add time.
            runs = [engines[backend].generate(ids, gen, SpecParams(algorithm=algorithm, budget=budget))
                    for _ in range(args.repeats)]
            outs[name] = min(runs, key=lambda r: r.elapsed_s)
        ref = outs[ar_name].output_ids
        if warm:
            continue
        for name, backend, config, _, _ in cfgs:
            res, r = outs[name], results[name]
            n = len(res.output_ids)
            own_ar = outs[label(backends, backend, "ar")]
            r["tok_s"].append(n / res.elapsed_s)
            r["paired"].append((n / res.elapsed_s) / (len(own_ar.output_ids) / own_ar.elapsed_s))
            if len(backends) > 1 and "transformers" in backends:
                twin = outs[label(backends, "transformers", config)]
                r["vs_tf"].append((n / res.elapsed_s) / (len(twin.output_ids) / twin.elapsed_s))
            r["tokens"] += n
            r["seconds"] += res.elapsed_s
            r["rounds"] += len(res.accept_lengths)
            r["accepted"] += sum(res.accept_lengths)
            r["mismatch"] += int(res.output_ids != ref)
            for k, v in (res.timings or {}).items():
                r["timings"][k] = r["timings"].get(k, 0.0) + v
        done = i + 1 - args.warmup
        if done % 4 == 0:
            print(f"  {done}/{len(prompts) - args.warmup} prompts, {time.perf_counter() - t_start:.0f}s", flush=True)

    print(f"\n{'config':<24} {'tau':>6} {'tau/dflash':>10} {'tok/s med':>10} {'vs AR':>7} {'paired':>7} "
          f"{'vs tf':>6} {'tok/s all':>10} {'mismatch':>8}  time split (draft/tree/verify/commit %)")
    summary = {}
    for name, backend, _, _, _ in cfgs:
        own = results[label(backends, backend, "ar")], results[label(backends, backend, "dflash")]
        ar_med = statistics.median(own[0]["tok_s"])
        dflash_tau = own[1]["accepted"] / max(1, own[1]["rounds"])
        r = results[name]
        tau = r["accepted"] / max(1, r["rounds"])
        med = statistics.median(r["tok_s"])
        total = sum(r["timings"].values()) or 1.0
        split = "/".join(f"{100 * r['timings'].get(k, 0.0) / total:.0f}" for k in ("draft", "tree", "verify", "commit"))
        paired = statistics.median(r["paired"])
        vs_tf = statistics.median(r["vs_tf"]) if r["vs_tf"] else None
        print(f"{name:<24} {tau:6.2f} {tau / dflash_tau:10.2f} {med:10.1f} {med / ar_med:7.2f} {paired:7.2f} "
              f"{'-' if vs_tf is None else f'{vs_tf:.2f}':>6} {r['tokens'] / r['seconds']:10.1f} {r['mismatch']:8d}  {split}")
        summary[name] = {"backend": engines[backend].backend, "tau": tau, "tok_s_median": med,
                         "speedup_vs_ar": med / ar_med, "speedup_vs_ar_paired_median": paired,
                         "vs_transformers_paired_median": vs_tf,
                         "tok_s_aggregate": r["tokens"] / r["seconds"], "mismatch_vs_ar": r["mismatch"],
                         "tokens": r["tokens"], "rounds": r["rounds"], "timings_s": r["timings"]}
    bests = {}
    for backend in backends:
        prefix = label(backends, backend, "")
        dflash_tau = summary[prefix + "dflash"]["tau"]
        best = bests[backend] = max((n for n, b, c, _, _ in cfgs if b == backend and c.startswith("ddtree")),
                                    key=lambda n: summary[n]["tok_s_median"])
        line = (f"\n{prefix}DFlash tau {dflash_tau:.2f}; DDTree best budget {best}: "
                f"{summary[best]['speedup_vs_ar']:.2f}x AR (paired median {summary[best]['speedup_vs_ar_paired_median']:.2f}x)")
        if prefix + "ddtree-64" in summary:
            line += f"; ddtree-64 tau / dflash tau = {summary[prefix + 'ddtree-64']['tau'] / dflash_tau:.2f}"
        print(line, end="")
    print()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                               # one backend: its best config's name; several: per backend
                                               "best": bests[backends[0]] if len(backends) == 1 else bests}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
