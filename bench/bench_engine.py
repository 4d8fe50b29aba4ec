"""Builtin engine benchmark: verify-forward cost per tree size, per-round overhead, end-to-end speed.

    # forward cost and engine overhead on random targets of real shapes (weights made on the device)
    python bench/bench_engine.py forward --device cuda --shapes 8b,1.7b --out bench-forward.json
    # AR vs DFlash vs DDTree on a real pair (the demo pair by default), tokens/s medians
    python bench/bench_engine.py e2e --device cpu --budgets 8,16,32 --out bench-e2e.json

Medians over repeats after warm-up, CUDA synchronised around every timed region; ratios come from
one run. Results are printed as a table and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)
    "8b": (4096, 12288, 36, 32, 8, 128, 151936),
    "1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
    "tiny": (256, 768, 4, 4, 2, 64, 4096),
}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_ms(fn, device: str, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _random_target(shape: str, device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, inter, layers, heads, kv, head_dim, vocab = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=head_dim, max_position_embeddings=40960, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    return model.eval()


def _random_drafter(model, block_size: int):
    from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids

    cfg = model.config
    n = cfg.num_hidden_layers
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        vocab_size=cfg.vocab_size, num_target_layers=n,
                        target_layer_ids=default_target_layer_ids(n, 1), mask_token_id=cfg.vocab_size - 1,
                        block_size=block_size)
    return DFlashDrafter(dcfg)


def host_work(sess, rounds: int = 3) -> dict:
    """A round's host work, untimed (counting slows it): per round, the median over `rounds` of
    the tensor ops run outside CUDA graphs (each a launch on a GPU), the host syncs, the
    host-to-device copies and the graph replays (fast/probe.HostWork says what counts)."""
    from ddtree.engine.reference.fast.probe import HostWork

    seen = []
    for _ in range(rounds):
        if sess.done:
            break
        with HostWork() as work:
            sess.step()
        seen.append(work.as_dict())
    return {k: statistics.median(d[k] for d in seen) for k in seen[0]} if seen else {}


def round_ms(engine, prompt, budgets: list[int], repeats: int) -> dict:
    """A DDTree round's parts (draft / tree / verify / commit), synchronised, median over rounds;
    "commit" holds the walk (decode times everything after the verify forward as commit). Each
    budget's row also counts a round's host work (host_work), unsynchronised, as served. (The
    fast path runs no draft ahead while a round's parts are timed: FastPath.walk_logits.)"""
    from ddtree.engine.reference.engine import GenParams, SpecParams

    engine.sync_timings = True
    rounds = {}
    for budget in budgets:
        sess = engine.start(prompt, GenParams(max_new_tokens=100_000, ignore_eos=True),
                            SpecParams("ddtree", budget))
        for _ in range(4):  # prefill, then warm rounds
            sess.step()
        per = {k: [] for k in ("draft", "tree", "verify", "commit")}
        try:
            for _ in range(repeats):
                before = dict(sess.timings)
                sess.step()
                for k in per:
                    per[k].append((sess.timings[k] - before[k]) * 1000)
        finally:
            engine.sync_timings = False
        work = host_work(sess)
        engine.sync_timings = True
        sess.close()
        med = {k: round(statistics.median(v), 3) for k, v in per.items()}
        med["round"] = round(sum(med[k] for k in per), 3)
        med["tree_walk_commit_ms"] = round(med["tree"] + med["commit"], 3)
        med["tree_walk_commit_share"] = round((med["tree"] + med["commit"]) / med["round"], 4)
        med.update(work)
        rounds[budget] = med
    engine.sync_timings = False
    return rounds


def bench_forward(args) -> dict:
    import torch

    from ddtree.engine.reference.engine import Engine
    from ddtree.engine.reference.target import Target
    from ddtree.engine.reference.tree import build_tree, tree_attention_mask

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    out = {"device": args.device, "dtype": str(dtype), "context": args.context, "shapes": {}}
    for shape in args.shapes:
        torch.manual_seed(0)
        model = _random_target(shape, args.device, dtype)
        target = Target(model, (model.config.num_hidden_layers // 2,))
        vocab = model.config.vocab_size
        ctx_ids = torch.randint(0, vocab, (args.context,), device=args.device)
        forward_ms = {}
        with torch.inference_mode():
            for nodes in args.nodes:
                cache = target.new_cache()
                target.forward(ctx_ids, torch.arange(args.context, device=args.device), cache)
                lp = torch.log_softmax(torch.randn(args.block_size - 1, vocab, device=args.device), -1)
                tree = build_tree(1, lp, nodes - 1) if nodes > 1 else None
                if tree is None:
                    ids, pos, mask = ctx_ids[:1], torch.tensor([args.context], device=args.device), None
                else:
                    ids, pos = tree.tokens, tree.depths + args.context
                    mask = None if tree.is_chain else tree_attention_mask(tree, args.context, dtype)

                def verify():
                    target.forward(ids, pos, cache, mask, features=True)
                    cache.crop(args.context)

                forward_ms[nodes] = round(_median_ms(verify, args.device, args.repeats), 3)
        # Whole rounds through a Session: the engine's own overhead (tree + walk/commit) vs the forward.
        engine = Engine(model, _random_drafter(model, args.block_size).to(args.device, dtype))
        prompt = torch.randint(0, vocab, (args.context,)).tolist()
        rounds = round_ms(engine, prompt, args.budgets, args.repeats)
        for med in rounds.values():
            non_forward = med["tree"] + med["commit"]
            med["overhead_share_of_round_excl_draft"] = round(non_forward / (non_forward + med["verify"]), 4)
        out["shapes"][shape] = {"verify_forward_ms": forward_ms, "round_ms": rounds}
        del engine, model, target
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def bench_e2e(args) -> dict:
    import torch

    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    if args.model is None:
        from ddtree.engine.demo import demo_paths

        args.model, args.draft = demo_paths()
    engine = Engine.load(args.model, args.draft, device=args.device)
    prompts = _prompts(engine, args.num_prompts)
    gen = GenParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    specs = [("ar", SpecParams("ar"))]
    if engine.drafter is not None:
        specs.append(("dflash", SpecParams("dflash")))
        specs += [(f"ddtree-{b}", SpecParams("ddtree", b)) for b in args.budgets]
    engine.generate(prompts[0], gen, specs[-1][1])  # warm-up
    per = {name: [] for name, _ in specs}
    taus = {name: [] for name, _ in specs}
    for _ in range(args.repeats):
        for prompt in prompts:
            for name, spec in specs:  # interleaved, so drift in machine load hits all alike
                r = engine.generate(prompt, gen, spec)
                per[name].append(len(r.output_ids) / r.elapsed_s)
                taus[name].append(r.tau_mean)
    ar = statistics.median(per["ar"])
    return {
        "device": args.device, "model": str(args.model), "draft": str(args.draft),
        "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
        "results": {name: {"tok_s_median": round(statistics.median(v), 2),
                           "speedup_vs_ar": round(statistics.median(v) / ar, 3),
                           "tau_mean": round(statistics.mean(taus[name]), 3)} for name, v in per.items()},
    }


def _prompts(engine, n: int) -> list[list[int]]:
    texts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self",
             "for i in range(10):\n    ", "def read_file(path):\n    with open(", "    return self."]
    if engine.tokenizer is None:
        return [[i % engine.target.vocab_size for i in range(3 + j, 19 + j)] for j in range(n)]
    return [engine.tokenizer(texts[i % len(texts)])["input_ids"] for i in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("forward", help="verify-forward cost per tree size and engine overhead per round")
    f.add_argument("--shapes", default="8b,1.7b", type=lambda s: s.split(","))
    f.add_argument("--context", type=int, default=1024)
    f.add_argument("--nodes", default="1,16,64,128,256", type=lambda s: [int(x) for x in s.split(",")])
    f.add_argument("--budgets", default="16,64,256", type=lambda s: [int(x) for x in s.split(",")])
    f.add_argument("--block-size", type=int, default=16)
    f.add_argument("--repeats", type=int, default=20)
    e = sub.add_parser("e2e", help="AR vs DFlash vs DDTree tokens/s on a real pair")
    e.add_argument("--model")
    e.add_argument("--draft")
    e.add_argument("--budgets", default="4,8,16,32", type=lambda s: [int(x) for x in s.split(",")])
    e.add_argument("--num-prompts", type=int, default=4)
    e.add_argument("--max-new-tokens", type=int, default=96)
    e.add_argument("--repeats", type=int, default=3)
    for sp in (f, e):
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
        sp.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench_forward(args) if args.mode == "forward" else bench_e2e(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
