"""A block size B below the drafter's trained block: the drafter still drafts its trained length
(it was trained on that), and only the first B-1 drafts are verified."""

import json

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

from .conftest import make_drafter, make_target


def _recording(drafter) -> list[int]:
    """Block lengths the drafter is fed, one per forward."""
    lengths: list[int] = []
    drafter.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    return lengths


@pytest.mark.parametrize("batched", [False, True])
def test_short_block_drafts_the_trained_length_and_verifies_at_most_b(batched):
    model = make_target(21)
    drafter = make_drafter(model, block_size=8, seed=4)
    lengths = _recording(drafter)
    engine = Engine(model, drafter, block_size=3)
    gen = GenParams(max_new_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 2, 33, 8], [1, 2, 3, 4, 5, 6, 7], [40, 41]]
    for spec in (SpecParams("dflash"), SpecParams("ddtree", 12)):
        ar = [engine.generate(p, gen, SpecParams("ar")).output_ids for p in prompts]
        sessions = [engine.start(p, gen, spec) for p in prompts]
        while not all(s.done for s in sessions):
            if batched:
                engine.step_many([s for s in sessions if not s.done])
            else:
                for s in sessions:
                    s.step()
        assert [s.output_ids for s in sessions] == ar
        assert all(1 <= t <= 3 for s in sessions for t in s.accept_lengths)
        assert all(len(s.accept_histogram()) == 3 for s in sessions)
    assert lengths and set(lengths) == {8}


def test_short_block_drafts_are_the_full_blocks_first_rows():
    model = make_target(22)
    full = Engine(model, make_drafter(model, block_size=8, seed=5))
    short = Engine(model, make_drafter(model, block_size=8, seed=5), block_size=4)
    drafts = []
    for engine in (full, short):
        sess = engine.start([3, 1, 4, 1, 5], GenParams(max_new_tokens=20), SpecParams("dflash"))
        sess.step()  # the prefill
        with torch.inference_mode():
            drafts.append(sess._draft(sess._depth_cap()))
    assert drafts[0].shape[0] == 7 and drafts[1].shape[0] == 3
    torch.testing.assert_close(drafts[1], drafts[0][:3])


# Held-out prompts of the demo pair (assets/prompts/code.jsonl) with a mix of short and long accepts.
HELD_OUT = (10, 20, 22, 33, 44, 53)


@pytest.fixture(scope="module")
def demo_engine():
    from ddtree.engine.demo import DemoMissing, demo_paths

    try:
        target, drafter = demo_paths()
    except DemoMissing:
        pytest.skip("the demo pair is not installed")
    engine = Engine.load(target, drafter)
    prompts_file = target.parent.parent / "prompts" / "code.jsonl"
    lines = prompts_file.read_text().splitlines()
    prompts = [engine.tokenizer.encode(json.loads(lines[i])["prompt"]) for i in HELD_OUT]
    return engine, prompts


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecParams("dflash"), SpecParams("ddtree", 16)], ids=["dflash", "ddtree16"])
def test_demo_pair_short_block_keeps_the_full_blocks_acceptance(demo_engine, spec):
    """tau at B is not below the full block's tau truncated at B (per round min(tau, B)); with a
    B-row block it was far below (issue 21: DFlash 1.21 against 2.49 at B=4)."""
    engine, prompts = demo_engine
    gen = GenParams(max_new_tokens=48, ignore_eos=True)
    trained = engine.drafter.block_size
    engine.block_size = trained
    try:
        full = [engine.generate(p, gen, spec) for p in prompts]
        for b in (4, 8):
            engine.block_size = b
            short = [engine.generate(p, gen, spec) for p in prompts]
            assert [r.output_ids for r in short] == [r.output_ids for r in full]  # still lossless
            rounds = [t for r in short for t in r.accept_lengths]
            truncated = [min(t, b) for r in full for t in r.accept_lengths]
            assert max(rounds) <= b
            assert sum(rounds) / len(rounds) >= sum(truncated) / len(truncated), (b, spec)
    finally:
        engine.block_size = trained
