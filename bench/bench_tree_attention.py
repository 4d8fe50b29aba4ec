"""The fused tree-attention kernel against the "matmul" kernel it replaces, one layer's attention
at a time, as CUDA graph replays, side by side in one run.

    python bench/bench_tree_attention.py --out tree-attention.json      # on a GPU
    python bench/bench_tree_attention.py --sweep --out sweep.json        # and every tiling too

For each shape (the Qwen3-8B and 1.7B attention in bf16, the demo target in float32), each node
count n (1 is an AR step; 17, 65, 257 tree verifies) and each context: microseconds per call,
median of repeats, for
- "matmul": the static path's attention before the kernel: the fold of the queries, the float32
  scores GEMM over the context's KV span, the mask add, the softmax, the second GEMM, the unfold
  (the mask itself is built once per forward and shared by the layers, so it is not counted);
- "triton": fast/tree_attention.py over the same cache, reading the length on the device.
Both over a cache whose rows past the context are never read by either. With --sweep, also
every tiling of a grid (tree_attention.Config) per case: the best, and what the default gives.
With --variants, the default tiling with other split counts, each used at every length: all the
splits planned for the cache (what a large cache used before _per_split gave short contexts the
fitted count), planned for the cache's own rows (the rule before tree_attention._PLAN_ROWS,
which starved short contexts in small caches), and planned with min_blocks 2 (more splits, a
longer merge).

With --batch B > 1 each case is a batched round's attention over the KV pool (fast/batch.py): B
rows, each over its own slot at the same context, the tilings fitted on one row. "matmul" then
runs row by row, only to check the output, and is not timed; the row reports instead the
bandwidth the kernel reached, the context's K/V bytes over its time (a batched AR round on the
1.7B shape spends about a quarter of its GPU time here, bench/RESULTS.md).

    python bench/bench_tree_attention.py --shapes 1.7b,8b --nodes 1,17 --contexts 512,1024 \
        --batch 16 --sweep --variants --out tree-attention-b16.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# name: (kv heads, query heads per kv head, head dim, dtype)
SHAPES = {"8b": (8, 4, 128, "bfloat16"), "1.7b": (8, 2, 128, "bfloat16"), "demo": (2, 2, 64, "float32")}


def _graph_us(fn, calls: int = 20, repeats: int = 7) -> float:
    """us per call: CUDA graph replays (the engine's own timer, rows.replay_us); on a CPU, where
    Triton's interpreter runs the kernel for a smoke run, one call's wall time."""
    import torch

    if not torch.cuda.is_available():
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from ddtree.engine.reference.fast.rows import replay_us

    return replay_us(fn, torch.device("cuda"), launches=calls, repeats=repeats)


def sweep_configs(rows_per_kv: int, dtype) -> list:
    """The tilings the sweep tries: query blocks up to the rows, key blocks, warps, stages,
    the fewest key blocks a split takes."""
    import torch

    from ddtree.engine.reference.fast.tree_attention import Config

    top = max(16, 1 << (rows_per_kv - 1).bit_length())
    if dtype == torch.float32:
        grid = [(m, n, 4, st) for m in (16, 32) for n in (16, 32, 64) for st in (2, 3)]
    else:
        grid = [(m, n, 4, st) for m in (16, 32) for n in (32, 64, 128) for st in (2, 3)]
        grid += [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    return [Config(m, n, w, st, mb) for m, n, w, st in grid if m <= top for mb in (2, 8)]


def case(shape: str, n: int, context: int, rows: int, sweep: bool = False, variants: bool = False,
         batch: int = 1) -> dict:
    import torch

    from ddtree.engine.reference.fast import tree_attention as fused
    from ddtree.engine.reference.fast.cache import kv_bucket
    from ddtree.engine.reference.fast.model import fold_mask, matmul_attention

    kvh, g, d, dtype = SHAPES[shape]
    dtype = getattr(torch, dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(n + context)
    q = torch.randn(batch * n, kvh * g, d, device=dev, dtype=dtype, generator=gen)
    keys = torch.randn(batch, kvh, rows, d, device=dev, dtype=dtype, generator=gen)
    values = torch.randn(batch, kvh, rows, d, device=dev, dtype=dtype, generator=gen)
    lengths = torch.full((batch,), context, device=dev)
    tree = (torch.rand(batch, n, n, device=dev, generator=gen) < 0.3) | torch.eye(n, dtype=torch.bool, device=dev)
    span = kv_bucket(rows, context + n)
    cols = torch.arange(span, device=dev) - context
    scale = d ** -0.5
    out = {}

    def matmul_row(r: int):
        seen = (cols < 0)[None, :] | (((cols >= 0) & (cols < n))[None, :] & tree[r].index_select(1, cols.clamp(0, n - 1)))
        mask = fold_mask(seen, g, torch.float32)[0]
        qf = q[r * n:(r + 1) * n].view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
        o = matmul_attention(qf, keys[r, :, :span], values[r, :, :span], scale, mask)
        return o.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, kvh * g * d)

    def matmul():
        return matmul_row(0)

    def triton():
        return fused.tree_attention(q, keys, values, lengths, tree, scale, rows).view(batch * n, kvh * g * d)

    want = torch.cat([matmul_row(r) for r in range(batch)]).float()
    got = triton().float()
    out["rel_diff"] = round(((got - want).norm() / want.norm()).item(), 7)
    out["triton_us"] = round(_graph_us(triton), 2)
    if batch == 1:
        out["matmul_us"] = round(_graph_us(matmul), 2)
        out["speedup"] = round(out["matmul_us"] / out["triton_us"], 2)
    else:
        out["matmul_us"] = out["speedup"] = None
    # What the kernel must read at least: every row's context K and V, once.
    out["gb_per_s"] = round(batch * kvh * (context + n) * d * 2 * keys.element_size() / (out["triton_us"] * 1e3), 1)
    if variants:
        base = fused.default_config(g * n, dtype, batch * kvh)
        row_blocks = -(-g * n // base.block_m)
        pairs = batch * kvh
        planned = fused.plan_splits(pairs, row_blocks, rows, torch.device(dev), base.block_n, base.min_blocks)
        own = max(1, min(planned, -(-rows // base.block_n // base.min_blocks)))
        more = fused.plan_splits(pairs, row_blocks, rows, torch.device(dev), base.block_n, 2)
        out["splits"] = {"default": None, "all planned": planned, "cache rows": own, "min 2 blocks": more}
        out["variants_us"] = {}
        for name, splits in out["splits"].items():
            def tiled(splits=splits):
                return fused.launch(q, keys, values, lengths, tree, scale, rows, base, splits)
            torch.testing.assert_close(tiled().float().view(batch * n, -1), got.view(batch * n, -1),
                                       rtol=2e-2, atol=2e-2)
            out["variants_us"][name] = round(_graph_us(tiled), 2)
    if sweep:
        tried = []
        for config in sweep_configs(g * n, dtype):
            def tiled(config=config):
                return fused.launch(q, keys, values, lengths, tree, scale, rows, config)
            try:
                us = _graph_us(tiled, calls=10, repeats=5)
            except Exception as exc:  # a tiling this GPU cannot run (shared memory): skipped
                tried.append({"config": config.__dict__, "error": str(exc)[:80]})
                continue
            # Every tiling computes the same attention, or its time means nothing.
            diff = ((tiled().float().view_as(want) - want).norm() / want.norm()).item()
            tried.append({"config": config.__dict__, "us": round(us, 2), "rel_diff": round(diff, 7)})
        ok = [t for t in tried if "us" in t]
        best = min(ok, key=lambda t: t["us"])
        out["best_us"], out["best_config"] = best["us"], best["config"]
        out["sweep_max_rel_diff"] = max(t["rel_diff"] for t in ok)
        out["sweep"] = tried
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8b,1.7b,demo", type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--nodes", default="1,17,65,257", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--contexts", default="1024,4096", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rows", type=int, default=8256, help="the cache's rows (a serving window of 8192 and its slack)")
    p.add_argument("--sweep", action="store_true", help="also time every tiling of a grid per case")
    p.add_argument("--variants", action="store_true",
                   help="also time the default tiling with the merge kernel, more blocks a split, the old split rule")
    p.add_argument("--batch", type=int, default=1,
                   help="rows of a batched round, each over its own pool slot (default: 1, one session)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error("--batch must be >= 1")
    import torch

    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "rows": args.rows, "batch": args.batch, "cases": []}
    print(f"batch {args.batch}; GB/s: the context's K/V bytes over the kernel's time")
    print(f"{'shape':6s} {'n':>4s} {'context':>7s} {'matmul us':>10s} {'triton us':>10s} {'x':>6s} {'GB/s':>7s} {'rel diff':>9s}")
    for shape in args.shapes:
        for context in args.contexts:
            for n in args.nodes:
                row = {"shape": shape, "n": n, "context": context,
                       **case(shape, n, context, args.rows, args.sweep, args.variants, args.batch)}
                result["cases"].append(row)
                best = ""
                if args.sweep:
                    c = row["best_config"]
                    best = (f"  best {row['best_us']:.2f} (m{c['block_m']} n{c['block_n']} w{c['warps']} "
                            f"s{c['stages']} b{c['min_blocks']}; every tiling's rel diff <= {row['sweep_max_rel_diff']:.1e})")
                if args.variants:
                    best += "  " + ", ".join(f"{k} {v:.2f}" for k, v in row["variants_us"].items())
                    best += " (splits " + ", ".join(f"{v}" for v in row["splits"].values() if v) + ")"
                timed = (f"{row['matmul_us']:10.2f} {row['triton_us']:10.2f} {row['speedup']:6.2f}"
                         if row["matmul_us"] is not None else f"{'-':>10s} {row['triton_us']:10.2f} {'-':>6s}")
                print(f"{shape:6s} {n:4d} {context:7d} {timed} {row['gb_per_s']:7.1f} {row['rel_diff']:9.2e}{best}",
                      flush=True)
                if args.out:
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
