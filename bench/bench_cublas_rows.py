"""cuBLAS at a verify's row counts under settings a process can choose, and with rows padded.

    python bench/bench_cublas_rows.py --device cuda [--shapes 8b] [--rows 1,17,33,65,72,...]
        [--configs default,lt,ws0,lt-ws0,no-rr] [--out cublas-rows.json]

A DDTree-64 verify of the 8B shape runs each decoder layer's four products at 65 rows on cuBLAS.
A profile (bench/RESULTS.md, ninth pass) showed two split-K reduce kernels and about two
`memcpy32_post` kernels a layer beside them, about 0.29 ms of a 5.8 ms verify. This asks whether
a setting or a padded row count gives the same products without them:
- default: torch's defaults;
- lt: torch.backends.cuda.preferred_blas_library("cublaslt");
- ws0 / lt-ws0: cuBLAS's (cuBLASLt's) workspace cut to 1 KiB, which leaves split-K no room;
- no-rr: allow_bf16_reduced_precision_reduction off.
Each setting runs in a process of its own (the workspace is read at cuBLAS's first use). For
each row count it times every product, and the layer's four in a row, as CUDA graph replays over
enough copies of the weights that each pass reads them from memory; and it lists the kernels
each product launches (torch.profiler, one eager call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_rows_tiles import SHAPES, products  # noqa: E402

CONFIGS = {
    "default": {},
    "ws0": {"CUBLAS_WORKSPACE_CONFIG": ":1:1"},
    "lt": {},
    "lt-ws0": {"CUBLASLT_WORKSPACE_SIZE": "1", "TORCH_CUBLASLT_WORKSPACE_SIZE": "1"},
    "no-rr": {},
}


def kernels_of(fn) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def child(config: str, shapes: list[str], rows: list[int], device: str, min_bytes: float) -> dict:
    import torch
    import torch.nn.functional as F

    from ddtree.engine.reference.fast.rows import replay_us

    if config in ("lt", "lt-ws0"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if config == "no-rr":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = torch.device(device)
    out = {"config": config, "gpu": torch.cuda.get_device_name(dev), "shapes": {}}
    for shape_name in shapes:
        prods = products(SHAPES[shape_name])
        layer_bytes = sum(n * k * 2 for n, k in prods.values())
        copies = max(1, int(-(-min_bytes // layer_bytes)))
        weights = {p: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
                   for p, (n, k) in prods.items()}
        per_rows = {}
        for m in rows:
            xs = {p: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for p, (n, k) in prods.items()}

            def one(p):
                return lambda: [F.linear(xs[p], w) for w in weights[p]]

            def layer():
                for c in range(copies):
                    for p in prods:
                        F.linear(xs[p], weights[p][c])

            row = {p: replay_us(one(p), dev) / copies for p in prods}
            row["layer"] = replay_us(layer, dev) / copies
            if m in (17, 33, 65, 72, 80, 129):
                try:
                    row["kernels"] = {p: kernels_of(lambda p=p: F.linear(xs[p], weights[p][0])) for p in prods}
                except Exception as exc:  # the listing is a side dish: never lose the timings to it
                    row["kernels"] = repr(exc)
            per_rows[str(m)] = row
            print(f"[{config}] {shape_name} rows {m:4d}: " + "  ".join(f"{p} {row[p]:7.2f}" for p in prods)
                  + f"  layer {row['layer']:7.2f} us", flush=True)
        out["shapes"][shape_name] = per_rows
        del weights
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="8b")
    ap.add_argument("--rows", default="1,17,33,48,64,65,72,80,96,128,129")
    ap.add_argument("--configs", default="default,ws0,lt,lt-ws0,no-rr")
    ap.add_argument("--min-bytes", type=float, default=600e6, help="weight copies: at least this many bytes a layer")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.child:
        print("JSON " + json.dumps(child(args.child, shapes, rows, args.device, args.min_bytes)), flush=True)
        return 0
    results = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            ap.error(f"unknown config {config!r} (known: {', '.join(CONFIGS)})")
        cmd = [sys.executable, __file__, "--child", config, "--shapes", args.shapes, "--rows", args.rows,
               "--device", args.device, "--min-bytes", str(args.min_bytes)]
        proc = subprocess.run(cmd, env={**os.environ, **CONFIGS[config]}, capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("JSON "):
                results.append(json.loads(line[5:]))
            else:
                print(line)
        if proc.returncode:
            print(f"[{config}] failed ({proc.returncode}): {proc.stderr[-1500:]}")
    for shape in shapes:
        print(f"\n{shape}: layer us (four products) by rows, per config")
        have = [r for r in results if shape in r["shapes"]]
        print("rows " + "".join(f"{r['config']:>10}" for r in have))
        for m in rows:
            print(f"{m:4d} " + "".join(f"{r['shapes'][shape][str(m)]['layer']:10.2f}" for r in have))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
