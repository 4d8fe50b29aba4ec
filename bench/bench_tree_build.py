"""The one-kernel tree build (fast/tree_build.py) against the torch steps it replaces, side by side
in one run, as CUDA graph replays of the whole build (the vocabulary's top-k included).

    python bench/bench_tree_build.py --out tree-build.json                 # on a GPU
    python bench/bench_tree_build.py --vocab 300 --budgets 8,16 --repeats 1 # a CPU smoke run

For each draft shape ("flat": random-weight logits, where pruning leaves depth 1 alone; "peaked":
logits scaled up as a trained drafter's are, so deep beams survive) and each budget: us per
build, median of repeats, for the torch steps (batch_tree.build_trees_steps) and the kernel, and
whether they built the same tree. On a CPU the kernel runs in Triton's interpreter (set
TRITON_INTERPRET=1), so the times there say nothing; the run checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# Logit scale of the synthetic drafts: randn * scale over the vocabulary.
DRAFTS = {"flat": 1.0, "peaked": 8.0}


def _us(fn, repeats: int) -> float:
    import torch

    if not torch.cuda.is_available():  # a smoke run: one call's wall time after a warm-up
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from ddtree.engine.reference.fast.rows import replay_us

    return statistics.median(replay_us(fn, torch.device("cuda"), launches=10, repeats=5) for _ in range(repeats))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary by default")
    p.add_argument("--depths", type=int, default=15, help="draft depths (a 16-token block)")
    p.add_argument("--budgets", default="16,32,64,128,256,512", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch

    from ddtree.engine.reference.fast import tree_build
    from ddtree.engine.reference.fast.batch_tree import build_trees_steps

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    roots = torch.arange(args.batch, device=device)
    rows = []
    print(f"{'draft':8} {'budget':>6} {'torch us':>10} {'kernel us':>10} {'ratio':>7}  same tree", flush=True)
    for draft, scale in DRAFTS.items():
        logits = (torch.randn(args.batch, args.depths, args.vocab, generator=g) * scale).to(device)
        logprobs = torch.log_softmax(logits, dim=-1)
        for budget in args.budgets:
            if not tree_build.runs(logprobs, budget) and device.type == "cuda":
                print(f"{draft:8} {budget:>6}  (wider than the kernel takes: the torch steps build it)", flush=True)
                continue
            steps = build_trees_steps(roots[:, None], logprobs, budget)
            kernel = tree_build.build(roots, logprobs, budget)
            same = bool(steps.tokens.equal(kernel[0]) and steps.parents.equal(kernel[2])
                        and steps.visible.equal(kernel[3]))
            depth = int(kernel[1].max())
            torch_us = _us(lambda: build_trees_steps(roots[:, None], logprobs, budget), args.repeats)
            kernel_us = _us(lambda: tree_build.build(roots, logprobs, budget), args.repeats)
            rows.append({"draft": draft, "budget": budget, "deepest": depth, "torch_us": round(torch_us, 1),
                         "kernel_us": round(kernel_us, 1), "torch_over_kernel": round(torch_us / kernel_us, 2),
                         "same_tree": same})
            print(f"{draft:8} {budget:>6} {torch_us:>10.1f} {kernel_us:>10.1f} {torch_us / kernel_us:>6.2f}x  "
                  f"{same} (deepest node {depth})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "vocab": args.vocab, "depths": args.depths,
                                        "batch": args.batch, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
