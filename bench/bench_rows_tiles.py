"""The few-row kernel's tilings against cuBLAS at a verify's row counts, on real model shapes.

    python bench/bench_rows_tiles.py --device cuda [--shapes 8b,1.7b] [--rows 17,65] [--dtype bf16]
        [--out tiles.json]

For each product of a decoder layer (q/k/v, o, gate/up, down) and row count: F.linear (cuBLAS)
against every tiling of a grid (row tile, output tile, input step, warps, pipeline stages), the
plain product (no folds), over enough copies of the weight that each pass reads it from memory,
not L2 (as a round does, layer after layer). Prints us a product and the weight bytes streamed
per second, the best tiling first; what the warm-up's tune tries (gemv.ROWS_TILES) is marked.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

# (hidden, intermediate, heads, kv heads, head dim) as bench_engine.SHAPES has them
SHAPES = {"8b": (4096, 12288, 32, 8, 128), "1.7b": (2048, 6144, 16, 8, 128), "demo": (256, 768, 4, 2, 64)}


def products(shape) -> dict[str, tuple[int, int]]:
    hidden, inter, heads, kv, hd = shape
    return {"qkv": ((heads + 2 * kv) * hd, hidden), "o": (hidden, heads * hd),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def grid(m: int):
    from ddtree.engine.reference.fast.gemv import RowsConfig, rows_configs

    cover = 16
    while cover < min(m, 64):
        cover *= 2
    tried = set(rows_configs(m))
    out = list(tried)
    for bm, bn, bk, w, st in itertools.product(sorted({16, cover}), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
        c = RowsConfig(bm, bn, bk, w, st)
        if c not in tried and bn * bk <= 128 * 128 and bm * bn <= 64 * 128:
            out.append(c)
    return out, tried


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="8b,1.7b")
    ap.add_argument("--rows", default="17,65")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--l2-bytes", type=float, default=200e6, help="weight copies per product: at least this many bytes")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from ddtree.engine.reference.fast.gemv import launch_rows
    from ddtree.engine.reference.fast.rows import replay_us

    if not torch.cuda.is_available():
        print("bench_rows_tiles: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for shape_name in args.shapes.split(","):
        for prod, (n, k) in products(SHAPES[shape_name]).items():
            size = n * k * dtype.itemsize
            copies = max(1, int(-(-args.l2_bytes // size)))
            weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
            for m in rows:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = F.linear(x, weights[0]).float()
                times = {"F.linear": replay_us(lambda: [F.linear(x, w) for w in weights], dev, 1) / copies}
                configs, tried = grid(m)
                for c in configs:
                    try:
                        got = launch_rows(x, weights[0], None, c).float()
                        err = (got - ref).abs().max().item() / ref.abs().max().item()
                        if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
                            print(f"  {c}: wrong output (max rel err {err:.3g})", flush=True)
                            continue
                        times[str(c)] = replay_us(lambda: [launch_rows(x, w, None, c) for w in weights], dev, 1) / copies
                    except Exception as e:  # a tiling past the SM's shared memory
                        print(f"  {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                ranked = sorted(times.items(), key=lambda kv: kv[1])
                row = {"shape": shape_name, "product": prod, "n": n, "k": k, "rows": m,
                       "weight_mb": round(size / 1e6, 2), "us": {name: round(us, 2) for name, us in ranked}}
                results.append(row)
                cub = times["F.linear"]
                tune_best = min((times[str(c)] for c in tried if str(c) in times), default=float("nan"))
                print(f"[{shape_name} {prod} {n}x{k} m={m}] F.linear {cub:.2f} us ({size / cub / 1e6:.2f} TB/s); "
                      f"tune's tiles best {tune_best:.2f}; grid best {ranked[0][0]} {ranked[0][1]:.2f} us "
                      f"({size / ranked[0][1] / 1e6:.2f} TB/s)", flush=True)
                for name, us in ranked[:4]:
                    mark = " (tune)" if any(str(c) == name for c in tried) else ""
                    print(f"    {us:8.2f} us  {name}{mark}", flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
