"""Few-row linears as the drafter and the tree verify run them, one way against another.

    python bench/bench_small_gemm.py --device cuda --dtype float32 --out small-gemm.json

For each (rows, in, out) it times F.linear, the same product with the operands swapped
((W @ x^T)^T, which cuBLAS sees as a different problem), and the rows padded to 32, each as
a CUDA graph of 20 launches (the way the engine replays them), median over repeats, in us per
product. It exists because a profile of the demo pair (float32) showed cuBLAS taking 30-50 us
for [16, 256] x [256, 256], where [17, 256] x [256, 256] took 9.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SHAPES = [(m, k, n) for m in (1, 8, 15, 16, 17, 32) for k, n in
          ((256, 128), (256, 256), (256, 512), (256, 768), (768, 256), (1024, 256), (256, 4096))]


def graph_us(fn, device: str, launches: int = 20, repeats: int = 15) -> float:
    """us per call: CUDA graph replays on a GPU (the engine's own timer, fast/rows.py), a host
    loop elsewhere (a smoke run)."""
    import torch

    if device.startswith("cuda"):
        from ddtree.engine.reference.fast.rows import replay_us

        return replay_us(fn, torch.device(device), launches, repeats)
    import time
    t0 = time.perf_counter()
    for _ in range(launches * repeats):
        fn()
    return (time.perf_counter() - t0) / (launches * repeats) * 1e6


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=args.device, dtype=dtype)
        w = torch.randn(n, k, device=args.device, dtype=dtype) / k ** 0.5
        padded = torch.zeros(32, k, device=args.device, dtype=dtype)
        padded[:m] = x
        out = torch.empty(m, n, device=args.device, dtype=dtype)
        row = {"m": m, "k": k, "n": n,
               "linear": graph_us(lambda: F.linear(x, w), args.device),
               "swapped": graph_us(lambda: torch.mm(w, x.t()).t(), args.device),
               "swapped_into": graph_us(lambda: out.copy_(torch.mm(w, x.t()).t()), args.device),
               "pad32": graph_us(lambda: F.linear(padded, w)[:m], args.device)}
        rows.append({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
        print(f"{m:3d} x {k:5d} -> {n:5d}: linear {row['linear']:7.2f}  swapped {row['swapped']:7.2f}  "
              f"swapped+copy {row['swapped_into']:7.2f}  pad32 {row['pad32']:7.2f} us", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "dtype": args.dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
