"""The demo drafter's served acceptance against its training metric, on the same sequences.

    .venv/bin/python bench/demo_tau_check.py [--num-prompts 4] [--max-new-tokens 256]

train_demo reports a teacher-forced chain acceptance: the mean, over every anchor of held-out
greedy continuations, of the leading drafts that match the target. Decoding steps through a
sequence in rounds and reports tokens per round, so long repetitive stretches (16 accepted at
each of their anchors) weigh far less in it. For each held-out prompt this decodes with DFlash
on the builtin engine (CPU), then runs the training code's teacher-forced drafter over prompt +
output and prints: the served tau, the per-anchor mean over the output, and the teacher-forced
acceptance at the anchors the decoding visited, which should equal the served one round for
round (a mismatch would be a serving bug: features, positions or masks unlike training's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(REPO / "assets" / "prompts" / "code.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch
    import transformers

    from ddtree.engine.demo import demo_paths
    from ddtree.engine.reference import train_demo
    from ddtree.engine.reference.drafter import load_drafter
    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

    torch.set_num_threads(args.threads)
    target_dir, draft_dir = demo_paths()
    engine = Engine.load(str(target_dir), str(draft_dir), device="cpu")
    target = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    drafter = load_drafter(draft_dir, device="cpu").float().eval()
    block, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    gen = GenParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    print(f"{'prompt':>6} {'served tau':>10} {'per-anchor mean':>15} {'at its anchors':>14} {'rounds equal':>12}")
    for row in rows[:args.num_prompts]:
        ids = engine.tokenizer.encode(row["prompt"], add_special_tokens=False)
        res = engine.generate(ids, gen, SpecParams("dflash"))
        seq = torch.tensor([ids + list(res.output_ids)])
        # An anchor is a round's bonus token: the prompt's next position, then one past each round.
        anchors = torch.arange(len(ids), seq.shape[1] - block)[None]
        with torch.no_grad():
            logits = train_demo.drafter_forward(drafter, target, seq, anchors, mask_id, block,
                                                torch.device("cpu"), torch.float32)
        labels = torch.gather(seq[:, None, :].expand(-1, anchors.shape[1], -1), 2,
                              anchors[:, :, None] + torch.arange(block))
        forced = train_demo.accept_lengths(logits, labels)[0].tolist()
        visited, at = [], len(ids)
        for tau in res.accept_lengths:
            if at - len(ids) < len(forced):
                visited.append(forced[at - len(ids)])
            at += tau
        served = res.accept_lengths[:len(visited)]
        print(f"{row['id']:>6} {sum(res.accept_lengths) / len(res.accept_lengths):10.2f} "
              f"{sum(forced) / len(forced):15.2f} {sum(visited) / len(visited):14.2f} "
              f"{sum(a == b for a, b in zip(served, visited)):>6}/{len(visited)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
