"""A lone session's next draft step queued before the host reads its walk (FastPath.walk_logits,
FastDrafter.draft_ahead), on the slot path that CUDA graphs capture, run on a CPU.

The walk writes everything the next draft step reads (the accepted features, their count, the
bonus), so that step runs before the host knows them. The next draft() takes its logits; a round
that is not that draft (a batched round over the pool, a new session on the slot) drops it and
puts the drafter's device length back. Either way the tokens are the reference's.
"""

from __future__ import annotations

import random

import pytest

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast.draft import FastDrafter, default_buckets
from ddtree.engine.reference.fast.probe import HostWork

from .conftest import make_drafter, make_target
from .test_fast_round_host import PROMPTS, _fast, _hide_graph_bound

SPECS = [SpecParams("dflash"), SpecParams("ddtree", 1), SpecParams("ddtree", 7), SpecParams("ddtree", 32)]


@pytest.fixture
def counts(monkeypatch):
    """How many draft steps ran ahead, were taken by the next draft, and were dropped."""
    seen = {"ahead": 0, "taken": 0, "dropped": 0}
    ahead, draft, settle = FastDrafter.draft_ahead, FastDrafter.draft, FastDrafter.settle

    def run_ahead(self, cache, length):
        seen["ahead"] += 1
        return ahead(self, cache, length)

    def run_draft(self, bonus, start, pending, cache, depth):
        before = cache.static.ahead if cache.static is not None else None
        out = draft(self, bonus, start, pending, cache, depth)
        if before is not None and cache.static.ahead is None and out.data_ptr() == cache.static.out.data_ptr():
            seen["taken"] += before == (cache.length - pending.shape[0], pending.shape[0], bonus)
        return out

    def run_settle(cache):
        seen["dropped"] += cache.static is not None and cache.static.ahead is not None
        return settle(cache)
    monkeypatch.setattr(FastDrafter, "draft_ahead", run_ahead)
    monkeypatch.setattr(FastDrafter, "draft", run_draft)
    monkeypatch.setattr(FastDrafter, "settle", staticmethod(run_settle))
    return seen


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.algorithm}-{s.budget}")
def test_drafts_run_ahead_decode_what_the_reference_decodes(spec, counts):
    model = make_target(63)
    ref = Engine(model, make_drafter(model, block_size=8, seed=5))
    fast = _fast(1)
    gen = GenParams(max_new_tokens=40, ignore_eos=True)
    rounds = 0
    for prompt in PROMPTS:
        got = fast.generate(prompt, gen, spec)
        want = ref.generate(prompt, gen, spec)
        assert got.output_ids == want.output_ids and got.accept_lengths == want.accept_lengths
        rounds += len(got.accept_lengths)
    # Every round but a request's first (and its last ones, near max_new_tokens) drafts from a
    # step run ahead; at most one a request is run for a round that never comes (the request
    # ended on more tokens than the last round was sure to commit).
    assert counts["ahead"] - len(PROMPTS) <= counts["taken"] <= counts["ahead"]
    assert counts["taken"] >= rounds - 3 * len(PROMPTS)
    assert counts["dropped"] == 0


def test_no_draft_runs_ahead_while_a_rounds_parts_are_timed(counts):
    """With Engine.sync_timings each part of a round is timed after the GPU drains: a draft
    ahead would be timed as the commit, so none runs (bench_engine.round_ms's split)."""
    fast = _fast(1)
    fast.sync_timings = True
    fast.generate(PROMPTS[0], GenParams(max_new_tokens=30, ignore_eos=True), SpecParams("ddtree", 16))
    assert counts["ahead"] == 0
    fast.sync_timings = False
    fast.generate(PROMPTS[0], GenParams(max_new_tokens=30, ignore_eos=True), SpecParams("ddtree", 16))
    assert counts["ahead"] > 0


def test_sampled_rounds_draw_the_same_with_and_without_drafts_ahead(counts):
    gen = GenParams(max_new_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)
    spec = SpecParams("ddtree", 16)
    ahead, plain = _fast(1), _fast(1)
    plain.impl.draft_ahead = False
    for prompt in PROMPTS:
        a, b = ahead.generate(prompt, gen, spec), plain.generate(prompt, gen, spec)
        assert a.output_ids == b.output_ids and a.accept_lengths == b.accept_lengths
    assert counts["taken"] > 0


@pytest.mark.parametrize("ahead", [True, False])
def test_a_round_with_its_draft_run_ahead_launches_nothing_for_the_draft(monkeypatch, ahead):
    """The walk writes the drafter's count and bonus, so no fill is left for them either way, and
    a round whose draft ran ahead runs no draft step of its own: outside what the graphs hold,
    a round launches the same (the verify's context length), and one draft step, not two."""
    fast = _fast(1)
    fast.impl.draft_ahead = ahead
    sess = fast.start(list(range(5, 40)), GenParams(max_new_tokens=60, ignore_eos=True), SpecParams("ddtree", 16))
    for _ in range(3):
        sess.step()
    _hide_graph_bound(monkeypatch)
    steps = []
    monkeypatch.setattr(FastDrafter, "_draft_static", lambda self, cache, bucket, real=FastDrafter._draft_static:
                        steps.append(bucket) or real(self, cache, bucket))
    for _ in range(3):
        with HostWork() as work:
            sess.step()
        assert work.launches <= 1 and work.h2d == 0, work.ops
    # Ahead, the draft runs at the widest append bucket (the count is not known on the host yet).
    assert steps == ([8] * 3 if ahead else [min(b for b in default_buckets(8) if b >= n)
                                            for n in sess.accept_lengths[-4:-1]])


def _pool_on_the_slot_path(engine: Engine) -> None:
    """What warmup makes of a pool on CUDA, without graphs: each slot's drafter cache static and
    paired with its target cache, the target on its static path."""
    impl = engine.impl
    engine.target.static = True
    impl._slots.clear()
    impl._free.clear()
    for i in range(impl.pool.slots):
        draft = impl.pool.draft_caches[i]
        impl.drafts._make_static(draft, default_buckets(engine.block_size))
        impl.add_slot(impl.pool.caches[i], draft)


def test_a_lone_sessions_draft_ahead_is_dropped_when_others_join_its_rounds(counts):
    """Sessions step alone while one runs and batch over the pool when several do: a draft run
    ahead by a lone session is not that batched round's (which appends and drafts itself, from
    the pool's device lengths), so it is dropped, and the tokens equal serial ones."""
    model = make_target(0)
    drafter = make_drafter(model, block_size=8, seed=1)
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=3)
    _pool_on_the_slot_path(pooled)
    rng = random.Random(3)
    jobs = [([rng.randrange(64) for _ in range(rng.randrange(2, 12))], rng.choice(SPECS), rng.randrange(20, 50))
            for _ in range(6)]
    want = [serial.generate(p, GenParams(max_new_tokens=n), s) for p, s, n in jobs]
    # One at a time for a while, then a second joins, then the first goes on alone, and so on.
    got, active, nxt, turn = {}, [], 0, 0
    while active or nxt < len(jobs):
        if nxt < len(jobs) and (not active or (turn % 7 == 3 and len(active) < 3)):
            prompt, spec, n = jobs[nxt]
            active.append((nxt, pooled.start(prompt, GenParams(max_new_tokens=n), spec)))
            nxt += 1
        pooled.step_many([s for _, s in active])
        for _, sess in active:  # the drafter's device length is the host's, plus a step run ahead
            cache = sess._draft_cache
            if cache is not None:
                ahead = cache.static.ahead  # a step run ahead from where this session's context ends
                assert ahead is None or ahead[0] == cache.length
                assert int(cache.length_t) == cache.length + (ahead[1] if ahead else 0)
        for item in list(active):
            if item[1].done:
                got[item[0]] = item[1]
                active.remove(item)
        turn += 1
    assert [got[j].output_ids for j in range(len(jobs))] == [w.output_ids for w in want]
    # The drafts too: a drafter context misplaced by a step left ahead would still decode the
    # same tokens (the target decides them), but accept fewer.
    assert [got[j].accept_lengths for j in range(len(jobs))] == [w.accept_lengths for w in want]
    assert counts["taken"] > 0 and counts["dropped"] > 0
    assert len(pooled.impl._free) == pooled.impl.pool.slots
