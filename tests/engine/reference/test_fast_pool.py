"""Batched rounds of the fast backend over its KV pool (issue 15, Tests).

CPU, float32. Sessions on pool slots step together through Engine.step_many (fast/batch.py): one
drafter forward and one target forward for every session, read in place from the pool. They must
decode exactly what each session decodes alone, with AR, DFlash and DDTree at several budgets in
one batch and sessions joining, finishing and being dropped at any round; and the pool must get
every slot back.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast import batch as fast_batch
from ddtree.engine.reference.fast.pool import KVPool, slot_bytes, slots_for

from .conftest import make_drafter, make_target

SPECS = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 1), SpecParams("ddtree", 4),
         SpecParams("ddtree", 16), SpecParams("ddtree", 64)]


@pytest.fixture(scope="module")
def pair():
    model = make_target(0)
    return model, make_drafter(model, block_size=8, seed=1)


def _jobs(seed: int, count: int, vocab: int = 64):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randrange(1, 14))], rng.choice(SPECS),
             rng.randrange(1, 40)) for _ in range(count)]


def _drive(engine: Engine, jobs, *, running: int, rng: random.Random | None = None, gens=None):
    """Run every job through step_many, at most `running` at once, new ones joining as others
    end; with rng, some sessions are closed or dropped (a client gone) mid-generation."""
    out, active, nxt, gone = {}, [], 0, set()
    while active or nxt < len(jobs):
        while len(active) < running and nxt < len(jobs):
            prompt, spec, n = jobs[nxt]
            gen = gens[nxt] if gens else GenParams(max_new_tokens=n)
            active.append((nxt, engine.start(prompt, gen, spec)))
            nxt += 1
        engine.step_many([s for _, s in active])
        for item in list(active):
            j, sess = item
            if sess.done:
                out[j] = sess.output_ids
                active.remove(item)
            elif rng is not None and rng.random() < 0.05:
                gone.add(j)
                active.remove(item)
                if rng.random() < 0.5:
                    sess.close()
                del sess, item  # the other half is dropped without close()
        gc.collect()
    return out, gone


def _spy(monkeypatch, module, name: str, record) -> list:
    """Calls of module.name from now on, each as record(*args) says; the function still runs."""
    calls = []
    real = getattr(module, name)

    def spy(*args):
        calls.append(record(*args))
        return real(*args)
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def counted(monkeypatch):
    return _spy(monkeypatch, fast_batch, "batched_round", lambda engine, sessions: len(sessions))


def test_batched_rounds_equal_serial_with_mixed_algorithms_and_joins(pair, counted):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=5)
    jobs = _jobs(0, 24)
    want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    got, _ = _drive(pooled, jobs, running=5)
    assert [got[j] for j in range(len(jobs))] == want
    assert counted and max(counted) == 5  # rounds really ran batched, up to the pool's size
    assert len(pooled.impl._free) == pooled.impl.pool.slots


def test_the_transformers_backend_decodes_the_same(pair):
    model, drafter = pair
    reference = Engine(model, drafter, backend="transformers", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=4)
    jobs = _jobs(3, 10)
    want = [reference.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    got, _ = _drive(pooled, jobs, running=4)
    assert [got[j] for j in range(len(jobs))] == want


def test_seeded_sampling_draws_the_same_batched(pair):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=4)
    jobs = _jobs(5, 8)
    gens = [GenParams(max_new_tokens=n, temperature=0.8, seed=100 + j) for j, (_, _, n) in enumerate(jobs)]
    want = [serial.generate(p, gens[j], s).output_ids for j, (p, s, _) in enumerate(jobs)]
    got, _ = _drive(pooled, jobs, running=4, gens=gens)
    assert [got[j] for j in range(len(jobs))] == want


def test_no_slot_leaks_after_random_joins_leaves_and_drops(pair):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=6)
    jobs = _jobs(7, 40)
    got, gone = _drive(pooled, jobs, running=6, rng=random.Random(11))
    assert gone and len(got) + len(gone) == len(jobs)
    for j in list(got)[:12]:  # the ones that ran to the end still decoded what serial decodes
        prompt, spec, n = jobs[j]
        assert got[j] == serial.generate(prompt, GenParams(max_new_tokens=n), spec).output_ids
    gc.collect()
    assert len(pooled.impl._free) == pooled.impl.pool.slots  # free rows equal total rows


def test_sessions_beyond_the_pool_run_alone_and_equal_serial(pair, counted):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=2)
    jobs = _jobs(9, 8)
    want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    got, _ = _drive(pooled, jobs, running=5)
    assert [got[j] for j in range(len(jobs))] == want
    assert counted and max(counted) == 2


def test_a_failing_round_changes_no_session(pair, monkeypatch):
    model, drafter = pair
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=3)
    sessions = [pooled.start([1, 2, 3], GenParams(max_new_tokens=20), SpecParams("ddtree", 8)) for _ in range(3)]
    pooled.step_many(sessions)  # prefills
    pooled.step_many(sessions)
    before = [(s._start, s._draft_cache.length, list(s.output_ids)) for s in sessions]
    lengths = pooled.impl.pool.lengths.clone()

    def broken(*args, **kwargs):
        raise RuntimeError("verify failed")
    monkeypatch.setattr(fast_batch, "verify_rows", broken)
    with pytest.raises(RuntimeError):
        pooled.step_many(sessions)
    assert [(s._start, s._draft_cache.length, list(s.output_ids)) for s in sessions] == before
    assert torch.equal(pooled.impl.pool.lengths, lengths)
    monkeypatch.undo()
    alone = Engine(model, drafter, backend="fast", max_budget=64)
    want = alone.generate([1, 2, 3], GenParams(max_new_tokens=20), SpecParams("ddtree", 8)).output_ids
    while not all(s.done for s in sessions):
        pooled.step_many(sessions)
    assert all(s.output_ids == want for s in sessions)


def test_pool_sizing(pair):
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=3)
    pool = engine.impl.pool
    per_slot = slot_bytes(engine.target, engine.impl.drafts)
    assert pool.nbytes() == 3 * per_slot
    assert slots_for(per_slot * 5 + 1, engine.target, engine.impl.drafts) == 5
    assert slots_for(per_slot - 1, engine.target, engine.impl.drafts) == 0
    with pytest.raises(BadParams):
        KVPool(engine.target, engine.impl.drafts, 0)


def test_pool_sizing_counts_the_drafter_rows_in_the_drafter_dtype(pair):
    import types

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16)
    drafts = engine.impl.drafts
    # The pool allocates the drafter's rows in its own dtype: a half-precision drafter beside an
    # fp32 target must be counted at 2 bytes an element, not the target's 4.
    half = types.SimpleNamespace(**{k: getattr(drafts, k) for k in
                                    ("num_layers", "num_kv_heads", "head_dim", "capacity", "block_size")},
                                 dtype=torch.bfloat16)
    assert engine.target.dtype == torch.float32
    pool = KVPool(engine.target, half, 2)
    assert pool.dk.dtype == torch.bfloat16
    assert pool.nbytes() == 2 * slot_bytes(engine.target, half)


def test_verify_timing_leaves_the_pool_as_it_was(pair):
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=3)
    before = engine.impl.pool.lengths.clone()
    assert fast_batch.verify_timing(engine, 3, 5, 20, repeats=2) > 0
    assert torch.equal(engine.impl.pool.lengths, before)


# ---- the graphed round's code (fast/batch_graph.py), run without graphs -----------------------
@pytest.fixture
def graphed(monkeypatch):
    from ddtree.engine.reference.fast import batch_graph

    return _spy(monkeypatch, batch_graph, "static_round", lambda engine, stage, mode, budget, b, span, chunk=0: (mode, budget, b))


@pytest.mark.parametrize("spec", [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 4),
                                  SpecParams("ddtree", 64)], ids=lambda s: f"{s.algorithm}{s.budget}")
def test_static_rounds_equal_serial(pair, graphed, spec):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=5)
    pooled.impl.batch_static = True
    rng = random.Random(21)
    jobs = [([rng.randrange(64) for _ in range(rng.randrange(1, 14))], spec, rng.randrange(1, 40))
            for _ in range(14)]
    want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    got, _ = _drive(pooled, jobs, running=5)
    assert [got[j] for j in range(len(jobs))] == want
    assert graphed and {b for _, _, b in graphed} <= {2, 4, 5}  # slots 0..b-1, b a power of two or all
    assert len(pooled.impl._free) == pooled.impl.pool.slots


def test_static_rounds_mixed_with_eager_ones_and_drops(pair, graphed):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=6)
    pooled.impl.batch_static = True
    jobs = _jobs(31, 30)
    got, gone = _drive(pooled, jobs, running=6, rng=random.Random(5))
    for j in got:
        prompt, spec, n = jobs[j]
        assert got[j] == serial.generate(prompt, GenParams(max_new_tokens=n), spec).output_ids, j
    gc.collect()
    assert len(pooled.impl._free) == pooled.impl.pool.slots


def test_round_widths_are_the_widths_the_trees_get(pair):
    """The graph key's query width, known before the round, is the bucket of the tree it builds."""
    from ddtree.engine.reference.fast import batch_graph
    from ddtree.engine.reference.fast.batch_tree import build_trees_device

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=256, pool_slots=2)
    depth = engine.block_size - 1
    logits = torch.randn(2, depth, engine.target.vocab_size).log_softmax(-1)
    for budget in (1, 2, 4, 16, 64, 255, 256):
        width = build_trees_device(torch.zeros(2, dtype=torch.long), logits, budget).width
        bucket = next(b for b in engine.target.buckets if b >= width)
        assert batch_graph._width(engine, "tree", budget, depth) == bucket, budget
    assert batch_graph._width(engine, "chain", 0, depth) == next(b for b in engine.target.buckets if b > depth)
    assert batch_graph._width(engine, "ar", 0, depth) == 1


def test_precapture_covers_every_batch_size_and_kind(pair, monkeypatch):
    from ddtree.engine.reference.fast import batch_graph

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=6)
    monkeypatch.setattr(batch_graph, "capture", lambda engine, stage, key: ("graph", key))
    said = []
    made = batch_graph.precapture(engine, (16, 64, 500), said.append)
    keys = set(engine.impl.round_stage().graphs)
    assert {k[:2] for k in keys} == {("ar", 0), ("chain", 0), ("tree", 16), ("tree", 64)}
    assert {k[4] for k in keys} == {0}  # no prefill chunk: no riders
    assert {k[2] for k in keys} == {2, 4, 6} and made == len(keys) and len(said) == 4
    # The smallest span of each kind is the one a round over a short context takes.
    from ddtree.engine.reference.fast.cache import kv_bucket

    rows = engine.target.new_cache_rows()
    for mode, budget in {k[:2] for k in keys}:
        q = batch_graph._width(engine, mode, budget, engine.block_size - 1)
        assert min(k[3] for k in keys if k[:2] == (mode, budget)) == kv_bucket(rows, 1 + q)


def test_precapture_with_mixed_chunks_captures_every_key_with_a_rider_too(pair, monkeypatch):
    from ddtree.engine.reference.fast import batch_graph, ride

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=8)
    engine.prefill_chunk, engine.mixed_chunk = 1000, True
    monkeypatch.setattr(batch_graph, "capture", lambda engine, stage, key: ("graph", key))
    batch_graph.precapture(engine, (16, 64))
    keys = set(engine.impl.round_stage().graphs)
    plain = {k[:4] for k in keys if not k[4]}
    for mode, budget, b, span in plain:
        q = batch_graph._width(engine, mode, budget, engine.block_size - 1)
        want = ride.shapes(engine, b * q)
        assert {k[4] for k in keys if k[:4] == (mode, budget, b, span) and k[4]} == set(want)
    # Narrow rounds take riders of up to 256 tokens; wide trees up to 512.
    assert {k[4] for k in keys} == {0, (1, 128), (1, 256), (4, 64), (1, 512), (8, 64)}


def test_a_new_lease_forgets_what_the_stage_held_for_its_slot(pair):
    """A graphed round's staged bonus and features belong to the session that ran it; the next
    session on that slot (whatever its id) is staged afresh."""
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=2)
    engine.impl.batch_static = True
    sessions = [engine.start([1, 2, 3], GenParams(max_new_tokens=6), SpecParams("ar")) for _ in range(2)]
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    stage = engine.impl.round_stage()
    assert stage.holds  # the rounds ran graphed and left their staging behind
    again = engine.start([4, 5], GenParams(max_new_tokens=4), SpecParams("ar"))
    assert engine.impl.pool.index_of(again._cache) not in stage.holds


def test_tree_layouts_are_never_evicted():
    """Captured graphs read the layouts' tensors by address and hold no reference to them."""
    from ddtree.engine.reference import tree

    assert tree._layout.cache_info().maxsize is None


def test_a_static_round_moves_every_row_of_a_full_depth_path(pair, monkeypatch):
    """The most a round can accept: the root and one node at every depth of the block. The
    trees are built from sharpened draft log-probs (so each holds the full-depth chain), and the
    walk is forced down each row's deepest path; every accepted K/V row must land right after
    the row's context, though the commit moves only as many rows as such a path holds."""
    from ddtree.engine.reference.fast import batch_graph

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=2)
    engine.impl.batch_static = True
    pool = engine.impl.pool
    seen = {}
    build, walk = batch_graph.build_trees_device, batch_graph.walk_batch

    def sharp_build(roots, logprobs, budget):  # each depth's best token at 0, the rest far below
        return build(roots, (logprobs - logprobs.amax(-1, keepdim=True)) * 50, budget)

    def deepest_walk(trees, posterior):
        forced = posterior.clone()
        for r in range(trees.batch):
            node = int(trees.depths[r].argmax())
            while node:
                parent = int(trees.parents[r, node])
                forced[r, parent] = trees.tokens[r, node]
                node = parent
        order, count = walk(trees, forced)
        if "order" not in seen:
            seen.update(k=pool.k.clone(), v=pool.v.clone(), start=pool.lengths.clone(), order=order.clone(),
                        count=count.clone(), width=trees.width)
        return order, count

    monkeypatch.setattr(batch_graph, "build_trees_device", sharp_build)
    monkeypatch.setattr(batch_graph, "walk_batch", deepest_walk)
    gen = GenParams(max_new_tokens=40, ignore_eos=True)
    sessions = [engine.start(p, gen, SpecParams("ddtree", 64)) for p in ([1, 2, 3], [4, 5, 6, 7, 8])]
    while "order" not in seen:
        engine.step_many(sessions)
    block = engine.block_size
    assert seen["width"] > block  # the commit's bound (the block) cuts something
    for r in range(2):
        start, count = int(seen["start"][r]), int(seen["count"][r])
        assert count == block  # the root and one accepted node at each of the block's depths
        src = [start + int(i) for i in seen["order"][r, :count]]
        dst = list(range(start, start + count))
        for cache, before in ((pool.k, seen["k"]), (pool.v, seen["v"])):
            torch.testing.assert_close(cache[:, r, :, dst], before[:, r, :, src], atol=0, rtol=0)


# ---- batched prefills (fast/prefill.py), run without graphs -----------------------------------
@pytest.fixture
def prefills(monkeypatch):
    """(padded size, prompts' lengths) of each packed forward."""
    from ddtree.engine.reference.fast import prefill

    return _spy(monkeypatch, prefill, "prefill_static", lambda engine, stage, size, lengths=None:
                (size, lengths[:-1]))


def test_a_turns_new_prompts_prefill_together_and_decode_as_serial(pair, prefills):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=6)
    pooled.impl.batch_static = True
    prompts = [[3], [5, 9, 1, 4, 4, 2, 8, 7, 7, 1, 30, 2, 6, 17, 20, 21, 40, 2], [1, 2, 3], [9] * 7, [60, 61]]
    specs = [SpecParams("ar"), SpecParams("ddtree", 16), SpecParams("dflash"), SpecParams("ddtree", 4),
             SpecParams("ar")]
    gen = GenParams(max_new_tokens=12)
    sessions = [pooled.start(p, gen, s) for p, s in zip(prompts, specs)]
    pooled.step_many(sessions)
    # All five end to end in one forward of 31 tokens, padded to 32.
    assert prefills == [(32, (1, 18, 3, 7, 2))]
    while not all(s.done for s in sessions):
        pooled.step_many(sessions)
    assert [s.output_ids for s in sessions] == [serial.generate(p, gen, s).output_ids
                                                for p, s in zip(prompts, specs)]


def test_prompts_past_a_pack_go_in_the_next_and_a_prompt_past_every_pack_alone(pair, prefills, monkeypatch):
    from ddtree.engine.reference.fast import prefill

    model, drafter = pair
    monkeypatch.setattr(prefill, "PREFILL_BATCH_TOKENS", 32)  # before the stage: packs of 32 tokens
    serial = Engine(model, drafter, backend="fast", max_budget=16)
    pooled = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=6)
    pooled.impl.batch_static = True
    rng = random.Random(4)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (10, 15, 12, 40, 20, 5)]
    specs = [SpecParams("ar"), SpecParams("ddtree", 8), SpecParams("dflash"), SpecParams("ddtree", 16),
             SpecParams("ar"), SpecParams("ddtree", 4)]
    gen = GenParams(max_new_tokens=10)
    sessions = [pooled.start(p, gen, s) for p, s in zip(prompts, specs)]
    pooled.step_many(sessions)
    # First come, first in a pack; the prompt of 40 prefills on its own (Session.step).
    assert prefills == [(32, (10, 15)), (32, (12, 20)), (16, (5,))]
    assert all(s.output_ids for s in sessions)
    while not all(s.done for s in sessions):
        pooled.step_many(sessions)
    assert [s.output_ids for s in sessions] == [serial.generate(p, gen, s).output_ids
                                                for p, s in zip(prompts, specs)]


def test_greedy_and_sampled_joiners_prefill_together_and_decode_as_serial(pair, prefills):
    """The greedy rows' first tokens come from one argmax over the batch; a sampled row's from
    its own draw with its own seed, as when it prefills alone."""
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=4)
    pooled.impl.batch_static = True
    prompts = [[3, 4], [5, 9, 1], [1, 2, 3, 7], [9] * 5]
    gens = [GenParams(max_new_tokens=8), GenParams(max_new_tokens=8, temperature=0.9, seed=11),
            GenParams(max_new_tokens=8), GenParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=5)]
    specs = [SpecParams("ar"), SpecParams("ar"), SpecParams("ddtree", 8), SpecParams("dflash")]
    sessions = [pooled.start(p, g, s) for p, g, s in zip(prompts, gens, specs)]
    pooled.step_many(sessions)
    assert prefills == [(16, (2, 3, 4, 5))]  # one forward for all four
    while not all(s.done for s in sessions):
        pooled.step_many(sessions)
    assert [s.output_ids for s in sessions] == [serial.generate(p, g, s).output_ids
                                                for p, g, s in zip(prompts, gens, specs)]


def test_a_batched_prefill_writes_only_its_prompts_rows(pair, prefills):
    """Running sessions' rows, free slots and the new slots past their prompts' padded length
    stay as they were."""
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=8)
    engine.impl.batch_static = True
    pool = engine.impl.pool
    gen = GenParams(max_new_tokens=30, ignore_eos=True)
    running = [engine.start([7, 8, 9, 10], gen, SpecParams("ddtree", 4)) for _ in range(2)]
    for _ in range(3):
        engine.step_many(running)
    k, v = pool.k.clone(), pool.v.clone()
    new = [engine.start(p, gen, SpecParams("ar")) for p in ([1, 2], [3, 4, 5], [6])]
    engine.step_many(new)
    assert prefills[-1:] == [(16, (2, 3, 1))]  # packed, and padded once
    slots = [pool.index_of(s._cache) for s in new]
    changed = torch.zeros(pool.k.shape[1:4], dtype=torch.bool)  # [slots, kv_heads, rows]
    for cache, before in ((pool.k, k), (pool.v, v)):
        changed |= (cache != before).any(dim=-1).any(dim=0)
    expected = torch.zeros_like(changed)
    for r, s in zip(slots, new):
        expected[r, :, :len(s.prompt_ids)] = True
    expected[slots[0], :, -1] = True  # the padding's scratch row, past every prompt
    assert changed[slots].any() and not (changed & ~expected).any()
    assert changed[slots[0], :, -1].all() and pool.k.isfinite().all() and pool.v.isfinite().all()
    assert all(int(pool.lengths[r]) == len(s.prompt_ids) for r, s in zip(slots, new))


def test_prefill_packs_fit_the_graph_sizes():
    from ddtree.engine.reference.fast import prefill

    sizes = prefill.pack_sizes(10**6)
    assert sizes[0] == prefill.PREFILL_MIN and sizes[-1] == prefill.PREFILL_BATCH_TOKENS and len(sizes) < 40
    assert list(sizes) == sorted(set(sizes))
    # Padding adds at most half past 32 tokens, and a quarter past 256.
    assert all(b / a <= (1.25 if a >= 256 else 1.5) for a, b in zip(sizes[1:], sizes[2:]))
    assert prefill.pack_sizes(1000)[-1] == 1024 and prefill.pack_sizes(3)[-1] == prefill.PREFILL_MIN
    assert prefill.pack_sizes(1024) == tuple(s for s in sizes if s <= 1024)
    rng = random.Random(3)
    for limit in (16, 100, 1024, 4096):
        for _ in range(100):
            lengths = [rng.choice([rng.randrange(1, 40), rng.randrange(1, limit + 40)]) for _ in range(rng.randrange(1, 70))]
            packs = prefill.plan_packs(lengths, limit)
            assert [j for p in packs for j in p] == [j for j, n in enumerate(lengths) if n <= limit]  # in order
            assert all(p and sum(lengths[j] for j in p) <= limit for p in packs)
            # A pack ends only where the next prompt would not fit.
            assert all(sum(lengths[j] for j in p) + lengths[q[0]] > limit for p, q in zip(packs, packs[1:]))
    # Sixty short prompts take one forward, not sixty.
    assert prefill.plan_packs([20] * 60, 4096) == [list(range(60))]


def test_prefill_precapture_covers_every_size(pair, monkeypatch):
    from ddtree.engine.reference.fast import prefill

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=5)
    monkeypatch.setattr(prefill, "capture", lambda engine, stage, size: ("graph", size))
    said = []
    stage = engine.impl.prefill_stage()
    prefill.precapture(engine, said.append)
    assert not stage.graphs and not said  # the CPU has no varlen kernel: nothing a graph can replay
    stage.packed_kernel = True
    prefill.precapture(engine, said.append)
    assert set(stage.graphs) == set(stage.sizes) and len(said) == 1
    assert stage.sizes == prefill.pack_sizes(5 * engine.context_window)


def test_prompts_that_join_together_append_to_the_drafter_together(pair, monkeypatch):
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=6)
    pooled.impl.batch_static = True  # the prefills batch too
    calls = _spy(monkeypatch, fast_batch, "append_context", lambda engine, feats, count, slots=None:
                 (tuple(feats.shape[:2]), None if slots is None else sorted(slots.tolist())))
    rng = random.Random(8)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (12, 20, 15, 3, 60)]
    specs = [SpecParams("ddtree", 16), SpecParams("dflash"), SpecParams("ddtree", 4), SpecParams("dflash"),
             SpecParams("ddtree", 8)]
    gen = GenParams(max_new_tokens=10)
    # What each prompt's prefill features and drafter keys are alone (no pool).
    want_feats, want_keys = [], []
    for p, s in zip(prompts, specs):
        alone = serial.start(p, gen, s)
        alone.step()
        want_feats.append(alone._pending.clone())
        alone.step()
        want_keys.append(alone._draft_cache.keys[:, :, :len(p)].clone())
        alone.close()
    running = [pooled.start([5, 6], gen, SpecParams("dflash"))]
    pooled.step_many(running)
    sessions = [pooled.start(p, gen, s) for p, s in zip(prompts, specs)]
    calls.clear()
    pooled.step_many(running + sessions)  # the prefills, then the prompts' appends in that turn
    assert [s._pending.shape[0] for s in sessions] == [0, 0, 0, 3, 0]
    torch.testing.assert_close(sessions[3]._pending, want_feats[3], rtol=1e-4, atol=1e-5)
    pooled.step_many(running + sessions)  # the round: the 3-row prompt's first draft appends it
    pool = pooled.impl.pool
    slots = [pool.index_of(s._cache) for s in sessions]
    for s, r, want in zip(sessions, slots, want_keys):  # in each session's own slot, at its rows
        torch.testing.assert_close(pool.dk[:, r, :, :want.shape[2]], want, rtol=1e-4, atol=1e-5)
        assert int(pool.dlengths[r]) == s._draft_cache.length
    # 60, 20 and 15 rows pad to 3 x 60, within twice their 95 real rows; 12 more would not (4 x 60
    # > 2 x 107), so it appends alone; 3 rows fit the first draft's own append. Each row's own
    # features, not another's: the keys above are each prompt's alone.
    assert calls[0] == ((3, 60), sorted(slots[j] for j in (1, 2, 4)))
    assert all(slots_of is None for _, slots_of in calls[1:])
    while not all(s.done for s in running + sessions):
        pooled.step_many([s for s in running + sessions if not s.done])
    assert [s.output_ids for s in sessions] == [serial.generate(p, gen, s).output_ids
                                                for p, s in zip(prompts, specs)]


def test_append_groups():
    assert fast_batch.append_groups([]) == []
    assert fast_batch.append_groups([30, 30, 30]) == [[0, 1, 2]]
    assert fast_batch.append_groups([12, 20, 15, 40]) == [[3, 1, 2, 0]]  # 4 x 40 <= 2 x 87
    assert fast_batch.append_groups([4, 20, 15, 40]) == [[3, 1, 2], [0]]  # 4 x 40 > 2 x 79
    assert fast_batch.append_groups([2000, 9, 9]) == [[0, 1], [2]]  # at most twice the real rows
    assert fast_batch.append_groups([5000, 9, 9]) == [[0], [1, 2]]  # at most _APPEND_ROWS padded
    groups = fast_batch.append_groups([500] * 40)
    assert sorted(j for g in groups for j in g) == list(range(40))
    assert all(len(g) * 500 <= fast_batch._APPEND_ROWS for g in groups)


def test_a_prefill_that_fails_leaves_its_session_new(pair, monkeypatch, prefills):
    from ddtree.engine.reference.decode import Session

    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=16)
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=4)
    engine.impl.batch_static = True
    gen = GenParams(max_new_tokens=8)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    sessions = [engine.start(p, gen, SpecParams("ddtree", 4)) for p in prompts]
    real = Session._prefilled

    def broken(self, logits, features, token=None):
        if self is sessions[1]:
            raise RuntimeError("sampler failed")
        return real(self, logits, features, token)
    monkeypatch.setattr(Session, "_prefilled", broken)
    with pytest.raises(RuntimeError):
        engine.step_many(sessions)
    assert prefills == [(16, (3, 4))]
    assert sessions[0].output_ids and not sessions[1].output_ids
    assert sessions[1]._cache.length == 0 and int(engine.impl.pool.lengths[engine.impl.pool.index_of(sessions[1]._cache)]) == 0
    monkeypatch.setattr(Session, "_prefilled", real)
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == [serial.generate(p, gen, SpecParams("ddtree", 4)).output_ids
                                                for p in prompts]


def test_a_turns_round_is_launched_between_its_prefill_and_the_first_tokens(pair, monkeypatch):
    """The running round goes in after the joiners' forward is queued and before their first
    tokens are read, so on a GPU the host's launch and bookkeeping overlap the prefill. By then
    the joiners' lengths are set: the round's rows for their slots (inactive in it) write past
    their prompts, and everyone decodes as serial."""
    from ddtree.engine.reference.fast import batch_graph, prefill

    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=16)
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=6)
    engine.impl.batch_static = True
    pool = engine.impl.pool
    gen = GenParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[7, 8, 9], [7, 8, 10], [9, 8, 7], [1, 2], [3, 4, 5]]
    specs = [SpecParams("ddtree", 4)] * 3 + [SpecParams("ar")] * 2
    running = [engine.start(p, gen, s) for p, s in zip(prompts[:3], specs)]
    engine.step_many(running)
    new = [engine.start(p, gen, s) for p, s in zip(prompts[3:], specs[3:])]
    order = []

    def spied(name, real):
        def spy(*args, **kwargs):
            order.append(name)
            if name == "graphed_round":  # slots 3 and 4: inactive rows of this b=4 round
                assert [int(pool.lengths[pool.index_of(s._cache)]) for s in new] == [2, 3]
            return real(*args, **kwargs)
        return spy
    for module, name in ((prefill, "_launch_pack"), (prefill, "_finish_pack"), (batch_graph, "graphed_round")):
        monkeypatch.setattr(module, name, spied(name, getattr(module, name)))
    engine.step_many(running + new)
    assert order == ["_launch_pack", "graphed_round", "_finish_pack"]
    parts = engine.turn_parts  # where the turn's host time went, for the server's turn trace
    assert list(parts) == ["decide", "launch", "round", "firsts", "after"] and min(parts.values()) >= 0
    engine.step_many(running)
    assert engine.turn_parts == {}  # a round with no joiners has none
    assert all(len(s.output_ids) == 1 for s in new) and all(len(s.output_ids) > 1 for s in running)
    monkeypatch.undo()
    sessions = running + new
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == [serial.generate(p, gen, s).output_ids
                                                for p, s in zip(prompts, specs)]


def test_the_writes_in_the_gpus_wait_count_towards_the_turn(pair):
    """Engine.gpu_busy times its on_gpu_wait (a server's writes) into turn_waits["push"], for the
    turn trace; each step_many starts the count afresh."""
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=2)
    engine.on_gpu_wait = lambda: time.sleep(0.001)
    engine.gpu_busy()
    engine.gpu_busy()
    assert set(engine.turn_waits) == {"push"} and engine.turn_waits["push"] >= 0.002
    engine.count_wait("gpu", 0.5)
    assert engine.turn_waits["gpu"] == 0.5
    engine.on_gpu_wait = None
    engine.step_many([engine.start([1, 2], GenParams(max_new_tokens=2), SpecParams("ar"))])
    assert engine.turn_waits == {}


def test_a_round_that_fails_beside_a_prefill_leaves_the_joiners_new(pair, monkeypatch):
    from ddtree.engine.reference.fast import batch_graph

    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=16)
    engine = Engine(model, drafter, backend="fast", max_budget=16, pool_slots=6)
    engine.impl.batch_static = True
    pool = engine.impl.pool
    gen = GenParams(max_new_tokens=10)
    prompts = [[7, 8, 9], [7, 8, 9, 10], [1, 2], [3, 4, 5]]
    sessions = [engine.start(p, gen, SpecParams("ddtree", 4)) for p in prompts]
    engine.step_many(sessions[:2])
    before = [(s._start, list(s.output_ids)) for s in sessions[:2]]

    def broken(*args, **kwargs):
        raise RuntimeError("round failed")
    monkeypatch.setattr(batch_graph, "static_round", broken)
    with pytest.raises(RuntimeError):
        engine.step_many(sessions)
    assert [(s._start, list(s.output_ids)) for s in sessions[:2]] == before
    for s in sessions[2:]:
        assert not s.output_ids and s._cache.length == 0 and int(pool.lengths[pool.index_of(s._cache)]) == 0
    monkeypatch.undo()
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == [serial.generate(p, gen, SpecParams("ddtree", 4)).output_ids
                                                for p in prompts]


def test_a_prompts_drafter_rows_go_in_with_its_prefill(pair):
    """A prompt longer than a draft block appends its features to its drafter rows in its prefill's
    turn, so the append's time counts in the first token's, not in the gap to the second; the
    next turn's round has nothing to append (batch_graph.eligible takes it as it is)."""
    from ddtree.engine.reference.fast import batch_graph

    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=4)
    engine.impl.batch_static = True
    gen = GenParams(max_new_tokens=6)
    sessions = [engine.start(list(range(1, 21)), gen, SpecParams("ddtree", 16)) for _ in range(2)]
    engine.step_many(sessions)
    assert all(len(s.output_ids) == 1 and s._pending.shape[0] == 0 for s in sessions)
    assert all(s._draft_cache.length == 20 for s in sessions)
    assert batch_graph.eligible(engine, sessions) == ("tree", 16)


@pytest.mark.parametrize("spec", [SpecParams("ar"), SpecParams("ddtree", 4)], ids=lambda s: f"{s.algorithm}{s.budget}")
@pytest.mark.parametrize("lone_slot", [0, 2])
def test_the_last_session_on_a_slot_without_graphs_takes_the_round_alone(pair, graphed, spec, lone_slot):
    """A c=16 point's last request, on a pool slot past the graphed ones, stepped alone ran its
    forward eagerly (33 ms on an H200 against a 2.5 ms round): it takes the round, a batch of
    one (the power of two that covers its slot), and decodes as serial."""
    model, drafter = pair
    serial = Engine(model, drafter, backend="fast", max_budget=64)
    pooled = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=4)
    pooled.impl.batch_static = True
    lengths = [3, 3, 3]
    lengths[lone_slot] = 20  # this one outlives the others
    jobs = [([5 + i, 9, 11 + i], spec, n) for i, n in enumerate(lengths)]
    want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    sessions = [pooled.start(p, GenParams(max_new_tokens=n), s) for p, s, n in jobs]
    assert [pooled.impl.pool.index_of(s._cache) for s in sessions] == [0, 1, 2]
    while not all(s.done for s in sessions):
        pooled.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == want
    lone = [b for _, _, b in graphed[-5:]]
    assert lone == [1 if lone_slot == 0 else 4] * 5  # slots 0..b-1: the lone row's round
    for s in sessions:
        s.close()
    gc.collect()
    assert len(pooled.impl._free) == pooled.impl.pool.slots


def test_a_session_on_a_graphed_slot_steps_alone_on_its_own_graphs(pair):
    model, drafter = pair
    engine = Engine(model, drafter, backend="fast", max_budget=64, pool_slots=4)
    engine.impl.batch_static = True
    session = engine.start([5, 9, 11], GenParams(max_new_tokens=4), SpecParams("ar"))
    assert not engine.lone_round(session)  # a prefill is no round
    session.step()
    assert engine.lone_round(session)
    session._cache.graphs[(1, 8)] = object()  # as FastTarget.capture leaves a graphed slot's cache
    assert not engine.lone_round(session)
    engine.impl.batch_static = False  # and with rounds on the pool eager, alone as before
    session._cache.graphs.clear()
    assert not engine.lone_round(session)
    session.close()
    assert not engine.lone_round(session)
