"""The builtin engine on a CPU, idle and shared with other work: torch's threads and how they wait.

    python bench/bench_cpu_threads.py                       # idle, then beside 2 busy processes
    python bench/bench_cpu_threads.py --load 0 --repeats 5

Each variant is a fresh process (OpenMP reads its environment once, when torch loads it) that
decodes the demo pair in process: AR, DFlash and DDTree-16, 48 new tokens, the median of 3 after a
warm-up. A variant is THREADS[:WAIT], WAIT being OMP_WAIT_POLICY for that process, or NAME=VALUE
(GOMP_SPINCOUNT=10000, say); "-" leaves both unset, so libgomp spins a while before it sleeps.
Variants run A B C A B C, and under each load the busy processes (pure Python loops, as many as
asked) run for the whole round. Prints each variant's median tok/s over the repeats, and its
ratio to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

TOKENS = 48
PROMPT = "Write a Python function that parses a CSV file and returns the rows as dicts."
ALGORITHMS = (("ar", None), ("dflash", None), ("ddtree", 16))


def child(threads: int, backend: str) -> None:
    import torch

    from ddtree.engine.demo import demo_paths
    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    torch.set_num_threads(threads)
    target, drafter = demo_paths()
    engine = Engine.load(target, drafter, device="cpu", backend=backend)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    gen = GenParams(max_new_tokens=TOKENS, ignore_eos=True)
    out = {}
    for algorithm, budget in ALGORITHMS:
        spec = SpecParams(algorithm, budget) if budget else SpecParams(algorithm)
        engine.generate(prompt, gen, spec)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine.generate(prompt, gen, spec)
            times.append(time.perf_counter() - t0)
        out[f"{algorithm}-{budget}" if budget else algorithm] = TOKENS / statistics.median(times)
    print(json.dumps(out), flush=True)


def _spin() -> None:
    while True:
        pass


def run_variant(variant: str, backend: str) -> dict[str, float]:
    threads, _, wait = variant.partition(":")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if wait and wait != "-":
        key, eq, value = wait.partition("=")
        env.update({key: value} if eq else {"OMP_WAIT_POLICY": wait})
    done = subprocess.run([sys.executable, __file__, "--child", threads, "--backend", backend],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="2:-,2:PASSIVE,1:-",
                   help="comma-separated THREADS[:OMP_WAIT_POLICY or NAME=VALUE] (default: 2:-,2:PASSIVE,1:-)")
    p.add_argument("--load", default="0,2", help="busy processes beside the decoding, per round (default: 0,2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="transformers", choices=("transformers", "fast"))
    p.add_argument("--out", default=None, help="write every sample as JSON here")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.backend)
        return 0
    variants = args.variants.split(",")
    samples: dict = {}
    print(f"cpus {os.cpu_count()}, backend {args.backend}, {TOKENS} new tokens, variants {variants}", flush=True)
    for load in (int(n) for n in args.load.split(",")):
        busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(load)]
        for proc in busy:
            proc.start()
        try:
            for repeat in range(args.repeats):
                for variant in variants:
                    got = run_variant(variant, args.backend)
                    samples.setdefault(str(load), {}).setdefault(variant, []).append(got)
                    print(f"  load {load} repeat {repeat + 1} {variant}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
        finally:
            for proc in busy:
                proc.terminate()
                proc.join()
        first = variants[0]
        print(f"load {load} (busy processes): median tok/s over {args.repeats}, and x {first}")
        for variant in variants:
            row = []
            for name in samples[str(load)][variant][0]:
                med = statistics.median(s[name] for s in samples[str(load)][variant])
                base = statistics.median(s[name] for s in samples[str(load)][first])
                row.append(f"{name} {med:6.1f} ({med / base:.2f}x)")
            print(f"  {variant:>10}: " + "  ".join(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpus": os.cpu_count(), "backend": args.backend, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
