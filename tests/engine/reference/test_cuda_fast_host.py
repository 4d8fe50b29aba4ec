"""A fast-backend round's host work on CUDA with graphs: what a round launches outside its four
graph replays (draft step, tree build, verify, walk) and that it syncs with the host once.
Run on the H200 by the lead (bench/gpu_fast.sh); skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast.probe import HostWork

from .conftest import make_drafter, make_target
from .test_fast_draft_ahead import counts  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def fast():
    model = make_target(41).to("cuda")
    engine = Engine(model, make_drafter(model, block_size=8, seed=4), backend="fast", max_budget=64, slots=1)
    engine.warmup(budgets=(16,))
    assert engine.graphs
    return engine


@pytest.mark.parametrize("spec", [SpecParams("ddtree", 16), SpecParams("dflash")], ids=["ddtree", "dflash"])
def test_a_round_is_four_replays_one_sync_and_a_few_fills(fast, spec):
    for work in _host_work(fast, spec):
        assert work.replays == 4, work.ops
        assert work.syncs == 1 and work.h2d == 0, work.ops
        assert work.launches <= 4, work.ops


def _host_work(engine, spec) -> list[HostWork]:
    """What each of a session's rounds 4-6 did on the host."""
    sess = engine.start(list(range(3, 40)), GenParams(max_new_tokens=200, ignore_eos=True), spec)
    works = []
    try:
        for _ in range(3):
            sess.step()
        for _ in range(3):
            with HostWork() as work:
                sess.step()
            works.append(work)
    finally:
        sess.close()
    return works


@pytest.mark.parametrize("spec", [SpecParams("ddtree", 16), SpecParams("dflash")], ids=["ddtree", "dflash"])
def test_drafts_run_ahead_on_graphs_decode_what_drafts_run_in_turn_decode(fast, spec, counts):
    """The next draft step replayed before the host reads the walk (FastDrafter.draft_ahead),
    wired by the warm-up's captures: its logits are taken, not drafted again, and the tokens are
    those of the draft step replayed at the next round's start. The acceptance may differ a
    little, not by much: ahead, the drafter's context rows go through its products at the widest
    append bucket, whose kernels may round differently."""
    prompts = [list(range(3, 40)), list(range(50, 61)), [7, 1, 7, 1, 9] * 6]
    gen = GenParams(max_new_tokens=120, ignore_eos=True)
    runs, taken = {}, {}
    for ahead in (False, True):
        fast.impl.draft_ahead = ahead
        try:
            runs[ahead] = [fast.generate(p, gen, spec) for p in prompts]
        finally:
            fast.impl.draft_ahead = True
        taken[ahead] = counts["taken"]
    assert taken[False] == 0 and taken[True] >= sum(len(r.accept_lengths) for r in runs[True]) - 3 * len(prompts)
    for a, b in zip(runs[True], runs[False]):
        assert a.output_ids == b.output_ids
        assert abs(len(a.accept_lengths) - len(b.accept_lengths)) <= max(2, len(b.accept_lengths) // 20)


def test_ar_steps_run_ahead_on_graphs_decode_as_steps_in_turn(fast):
    """A lone greedy AR step with the next one queued before its token is read
    (fast/step_ahead.py): one replay and one sync a step, nothing copied from the host, every
    step but a request's first two taken from the one run ahead (its first runs none), and the
    tokens of steps run in turn (round_ahead off)."""
    prompts = [list(range(3, 40)), list(range(50, 61)), [7, 1, 7, 1, 9] * 6]
    gen = GenParams(max_new_tokens=100, ignore_eos=True)
    runs = {}
    for ahead in (False, True):
        fast.impl.round_ahead = ahead
        before = dict(fast.impl.steps.counts)
        try:
            runs[ahead] = [fast.generate(p, gen, SpecParams("ar")).output_ids for p in prompts]
        finally:
            fast.impl.round_ahead = True
        got = {k: fast.impl.steps.counts[k] - before[k] for k in before}
        want = {"launched": 97 * len(prompts), "taken": 97 * len(prompts), "dropped": 0} if ahead else \
            {"launched": 0, "taken": 0, "dropped": 0}
        assert got == want
    assert runs[True] == runs[False]
    for work in _host_work(fast, SpecParams("ar")):
        assert work.replays == 1, work.ops
        assert work.syncs == 1 and work.h2d == 0, work.ops
