"""Engine.step_many: rounds of many sessions in one drafter and one target forward, lossless."""

import math

import pytest
import torch

from ddtree.engine.reference import batch
from ddtree.engine.reference.decode import Session
from ddtree.engine.reference.drafter import DraftCache
from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.errors import BadParams

from .conftest import OracleDrafter, make_drafter, make_target

SPECS = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 0), SpecParams("ddtree", 1),
         SpecParams("ddtree", 2), SpecParams("ddtree", 7), SpecParams("ddtree", 16), SpecParams("ddtree", 64)]


def _prompts(lengths, seed: int, vocab: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _three_algorithms(seed: int, lengths, max_new: int):
    """An engine on a fresh tiny pair, one ddtree/dflash/ar job a prompt, and each job's tokens alone."""
    model = make_target(seed)
    engine = Engine(model, make_drafter(model, block_size=8))
    specs = (SpecParams("ddtree", 16), SpecParams("dflash"), SpecParams("ar"))
    jobs = [(p, GenParams(max_new_tokens=max_new, ignore_eos=True), s) for p, s in zip(_prompts(lengths, seed), specs)]
    return engine, jobs, [engine.generate(*job).output_ids for job in jobs]


def _run_batched(engine, jobs, *, join_every: int = 2, on_start=None) -> list[Session]:
    """Start one job every `join_every` rounds while stepping all live sessions together."""
    waiting, sessions, rounds = list(jobs), [], 0
    while waiting or any(not s.done for s in sessions):
        if waiting and rounds % join_every == 0:
            sessions.append(engine.start(*waiting.pop(0)))
            if on_start:
                on_start(sessions[-1])
        live = [s for s in sessions if not s.done]
        got = engine.step_many(live)
        assert len(got) == len(live)
        rounds += 1
    return sessions


@pytest.fixture(params=["split", "one-batch"])
def grouping(request, monkeypatch):
    """CPU grouping by tree size, and the single padded batch CUDA uses."""
    if request.param == "one-batch":
        monkeypatch.setattr(batch, "CPU_PADDING_SLACK", math.inf)
    return request.param


# One combination runs in the quick set (./dev.sh quick); the others are the same check at ~2 s each.
@pytest.mark.parametrize("attn,block_size", [pytest.param("sdpa", 4, marks=pytest.mark.slow), ("sdpa", 8),
                                             pytest.param("eager", 8, marks=pytest.mark.slow)])
def test_batched_rounds_equal_serial(attn, block_size, grouping):
    model = make_target(20 + block_size, attn=attn)
    engine = Engine(model, make_drafter(model, block_size=block_size, seed=block_size))
    lengths = [3, 29, 11, 47, 5, 18, 36, 8]
    prompts = _prompts(lengths, block_size)
    gens = [GenParams(max_new_tokens=n, ignore_eos=True) for n in (20, 31, 9, 26, 17, 40, 12, 23)]
    jobs = list(zip(prompts, gens, SPECS))
    serial = [engine.generate(*job) for job in jobs]
    sessions = _run_batched(engine, jobs)
    accepted = 0
    for job, sess, ref in zip(jobs, sessions, serial):
        assert sess.output_ids == ref.output_ids, job[2]
        # Same inputs per row, so even the drafts (and hence tau) match the single path.
        assert sess.accept_lengths == ref.accept_lengths, job[2]
        assert sess.verify_ct == ref.verify_ct and sess.finish_reason == "length"
        accepted += sum(t - 1 for t in sess.accept_lengths)
    assert accepted > 0


@pytest.mark.parametrize("attn,keep_logits", [("sdpa", True), pytest.param("eager", True, marks=pytest.mark.slow),
                                              pytest.param("sdpa", False, marks=pytest.mark.slow)])
def test_sessions_started_together_prefill_in_one_forward_and_equal_serial(attn, keep_logits, grouping,
                                                                          monkeypatch):
    model = make_target(41, attn=attn)
    engine = Engine(model, make_drafter(model, block_size=8, seed=41))
    if not keep_logits:  # a model whose forward has no logits_to_keep: all rows come back
        monkeypatch.setattr(engine.target, "has_logits_to_keep", False)
    lengths = [3, 29, 11, 47, 5, 18, 36, 8]
    prompts = _prompts(lengths, 41)
    gens = [GenParams(max_new_tokens=n, ignore_eos=True) for n in (20, 31, 9, 26, 17, 40, 12, 23)]
    gens[2] = GenParams(max_new_tokens=15, temperature=0.8, seed=7, ignore_eos=True)  # seeded sampling too
    jobs = list(zip(prompts, gens, SPECS))
    serial = [engine.generate(*job) for job in jobs]
    calls = []
    group = batch._prefill_group
    monkeypatch.setattr(batch, "_prefill_group", lambda e, ss: calls.append(len(ss)) or group(e, ss))
    sessions = [engine.start(*job) for job in jobs]
    first = engine.step_many(sessions)
    assert sum(calls) >= 2 and all(len(f) == 1 for f in first)  # prefills shared a forward
    if grouping == "one-batch":
        assert calls == [8]
    padded = []
    monkeypatch.setattr(batch, "_prefill_group",
                        lambda e, ss: padded.append(len(ss) * max(len(s.prompt_ids) for s in ss)) or group(e, ss))
    monkeypatch.setattr(batch, "PREFILL_BATCH_TOKENS", 100)
    engine.step_many([engine.start(*job) for job in jobs])
    assert padded and max(padded) <= 100
    while any(not s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    for job, sess, ref in zip(jobs, sessions, serial):
        assert sess.output_ids == ref.output_ids, job[2]
        assert sess.accept_lengths == ref.accept_lengths, job[2]


def test_batched_against_plain_ar_with_a_branching_oracle():
    """Long accepted paths through non-leftmost branches, rows compacted inside the batch."""
    model = make_target(6, layers=2)
    oracle = BatchOracle(model, 8, sharpen=4.0, noise=0.4, seed=3)
    engine = Engine(model, oracle)
    prompts = _prompts([4, 13, 7, 21, 10], 6)
    gens = [GenParams(max_new_tokens=n, ignore_eos=True) for n in (30, 24, 36, 18, 28)]
    specs = [SpecParams("ddtree", b) for b in (3, 12, 48)] + [SpecParams("dflash"), SpecParams("ddtree", 24)]
    ar = [engine.generate(p, g, SpecParams("ar")).output_ids for p, g in zip(prompts, gens)]
    skipped = []
    walk = Session._walk

    def recording_walk(self, tree, logits, ahead=False):
        path, path_list, new = walk(self, tree, logits, ahead)
        skipped.append(path_list[-1] != len(path_list) - 1)
        return path, path_list, new

    Session._walk = recording_walk
    try:
        sessions = _run_batched(engine, list(zip(prompts, gens, specs)), join_every=3,
                                on_start=oracle.sessions.append)
    finally:
        Session._walk = walk
    for sess, ref in zip(sessions, ar):
        assert sess.output_ids == ref
    assert max(max(s.accept_lengths) for s in sessions) >= 4
    assert any(skipped)  # some path skipped rows, so the batch really gathered KV rows
    assert oracle.batched_calls > 0


def test_steady_batches_reuse_the_previous_batched_cache(monkeypatch):
    """Same sessions in the same order: the stacked caches are the last round's tensors, no copy."""
    engine, jobs, serial = _three_algorithms(15, [6, 21, 13], 30)
    hits = []
    shared = batch._shared_base

    def recording(tensors, width):
        base = shared(tensors, width)
        hits.append(base is not None)
        return base

    monkeypatch.setattr(batch, "_shared_base", recording)
    sessions = _run_batched(engine, jobs, join_every=1)
    assert [s.output_ids for s in sessions] == serial
    assert any(hits) and not all(hits)


def test_seeded_sampling_is_the_same_batched_or_alone():
    model = make_target(11)
    engine = Engine(model, make_drafter(model, block_size=8))
    prompts = _prompts([4, 19, 9, 30], 11)
    specs = [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 16), SpecParams("ddtree", 5)]
    gens = [GenParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
            for i in range(4)]
    jobs = list(zip(prompts, gens, specs))
    serial = [engine.generate(*job).output_ids for job in jobs]
    sessions = _run_batched(engine, jobs, join_every=1)
    assert [s.output_ids for s in sessions] == serial
    assert len(set(map(tuple, serial))) == 4


def test_stop_tokens_and_context_window_inside_a_batch():
    model = make_target(9, max_pos=48)
    engine = Engine(model, make_drafter(model, block_size=8), eos_token_ids=())
    prompt = [4, 5, 6]
    full = engine.generate(prompt, GenParams(max_new_tokens=20), SpecParams("ar")).output_ids
    stop = full[5]
    jobs = [(prompt, GenParams(max_new_tokens=20, stop_token_ids=[stop]), SpecParams("ddtree", 16)),
            (list(range(30)), GenParams(max_new_tokens=50, ignore_eos=True), SpecParams("dflash")),
            (prompt, GenParams(max_new_tokens=7), SpecParams("ddtree", 4)),
            (list(range(10, 40)), GenParams(max_new_tokens=50, ignore_eos=True), SpecParams("ddtree", 32))]
    serial = [engine.generate(*job) for job in jobs]
    sessions = _run_batched(engine, jobs, join_every=1)
    for sess, ref in zip(sessions, serial):
        assert (sess.output_ids, sess.finish_reason) == (ref.output_ids, ref.finish_reason)
    assert sessions[0].finish_reason == "stop" and sessions[0].output_ids == full[:full.index(stop) + 1]
    assert len(sessions[1].output_ids) == 48 - 30 + 1


def test_a_failing_forward_changes_no_session(monkeypatch):
    engine, jobs, serial = _three_algorithms(13, [5, 12, 8], 16)
    sessions = [engine.start(*job) for job in jobs]
    engine.step_many(sessions)  # prefill
    engine.step_many(sessions)
    before = [(list(s.output_ids), s._start, s.verify_ct, s._cache.seq_length()) for s in sessions]

    def boom(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.target, "forward_batch", boom)
    with pytest.raises(RuntimeError):
        engine.step_many(sessions)
    assert [(list(s.output_ids), s._start, s.verify_ct, s._cache.seq_length()) for s in sessions] == before
    monkeypatch.undo()
    while not all(s.done for s in sessions):  # alone, then batched again: still exact
        sessions[0].step()
        engine.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == serial


def test_step_many_edges():
    model = make_target(0, layers=2)
    engine = Engine(model, make_drafter(model, block_size=4))
    other = Engine(model, make_drafter(model, block_size=4))
    a = engine.start([1, 2, 3], GenParams(max_new_tokens=3), SpecParams("ddtree", 4))
    assert engine.step_many([]) == []
    with pytest.raises(BadParams):
        engine.step_many([a, a])
    with pytest.raises(BadParams):
        engine.step_many([a, other.start([1], GenParams(), SpecParams())])
    first = engine.step_many([a])
    assert first == [a.output_ids] and len(a.output_ids) == 1  # the prefill commits the first token
    while not a.done:
        engine.step_many([a])
    assert engine.step_many([a]) == [[]]
    assert engine.step_many([a, engine.start([4, 5], GenParams(max_new_tokens=2), SpecParams("ar"))])[0] == []


def test_batched_timings_are_shared():
    model = make_target(14)
    engine = Engine(model, make_drafter(model, block_size=8))
    jobs = [(p, GenParams(max_new_tokens=12, ignore_eos=True), SpecParams("ddtree", 8)) for p in _prompts([6, 9], 14)]
    sessions = _run_batched(engine, jobs, join_every=1)
    for s in sessions:
        assert all(v >= 0 for v in s.timings.values())
        assert s.timings["verify"] > 0 and s.timings["draft"] > 0


class BatchOracle(OracleDrafter):
    """OracleDrafter that also drafts a batch: row j is matched to its session by (position, bonus).

    Two live sessions can share both only by chance; the draft then follows one of them, which can
    cost acceptance but never correctness (the test checks outputs against plain AR).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: list[Session] = []
        self.batched_calls = 0

    def new_cache(self):
        return DraftCache(1)

    def forward(self, noise_embeds, target_hidden, position_ids, attention_mask=None, past_key_values=None):
        b, c = target_hidden.shape[:2]
        stub = torch.zeros(b, 1, c, 1)
        past_key_values.append(0, stub, stub.clone())  # real rows, so batching pads and gathers them
        if b > 1:
            self.batched_calls += 1
        embed = self.target[0].get_input_embeddings().weight
        rows = []
        for j in range(b):
            start = int(position_ids[j, -self.block_size])
            bonus = int((embed == noise_embeds[j, 0]).all(-1).nonzero()[0])
            self.session = next(s for s in reversed(self.sessions) if s._start == start and s._bonus == bonus)
            rows.append(self._draft_rows())
        return torch.stack(rows)
