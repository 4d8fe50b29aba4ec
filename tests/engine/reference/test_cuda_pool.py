"""The KV pool's batched rounds on CUDA with graphs (issue 15): greedy output equals serial
decoding token for token in fp32, the graphed rounds really ran, and every slot comes back.
Run on the H200 by the lead; skipped without CUDA."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

from .conftest import make_drafter, make_target
from .test_chunked_prefill import CHUNK, burst_beside_a_prompt_part_in
from .test_fast_pool import SPECS, _drive, _jobs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engines():
    model = make_target(0).cuda()
    drafter = make_drafter(model, block_size=8, seed=1)
    serial = Engine(model, drafter, backend="fast", max_budget=64, slots=1, compile=False)
    serial.warmup()
    pooled = Engine(model, drafter, backend="fast", max_budget=64, slots=2, pool_slots=8, compile=False)
    pooled.warmup()
    return serial, pooled


@pytest.mark.parametrize("spec", [s for s in SPECS if s.budget != 1], ids=lambda s: f"{s.algorithm}{s.budget}")
def test_graphed_rounds_equal_serial(engines, spec):
    serial, pooled = engines
    rng = random.Random(3)
    jobs = [([rng.randrange(64) for _ in range(rng.randrange(1, 30))], spec, rng.randrange(1, 40))
            for _ in range(10)]
    want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
    got, _ = _drive(pooled, jobs, running=7)
    assert [got[j] for j in range(len(jobs))] == want
    stage = pooled.impl.round_stage()
    assert any(key[0] == pooled.start([1], GenParams(), spec).mode for key in stage.graphs)
    gc.collect()
    assert len(pooled.impl._free) == pooled.impl.pool.slots


def test_mixed_rounds_and_drops_on_cuda(engines):
    serial, pooled = engines
    jobs = _jobs(17, 16)
    got, gone = _drive(pooled, jobs, running=8, rng=random.Random(2))
    for j in got:
        prompt, spec, n = jobs[j]
        assert got[j] == serial.generate(prompt, GenParams(max_new_tokens=n), spec).output_ids, j
    gc.collect()
    assert len(pooled.impl._free) == pooled.impl.pool.slots


@pytest.mark.parametrize("spec", [SpecParams("ar"), SpecParams("ddtree", 16)], ids=lambda s: s.algorithm)
def test_graphed_rounds_with_riding_chunks_equal_serial(engines, spec, monkeypatch):
    """--enable-mixed-chunk: joining prompts ride in the graphed rounds a chunk at a time (the
    rider graphs captured by the warm-up, the chunks' attention over their slots in place). The
    rider widths scaled down (RIDE_MIN 4, RIDE_ROW 2, RIDE_MAX 16), so that these small rounds capture every
    shape and take lone riders and several riders a round."""
    from ddtree.engine.reference.fast import ride

    monkeypatch.setattr(ride, "RIDE_MIN", 4)
    monkeypatch.setattr(ride, "RIDE_MAX", 16)
    monkeypatch.setattr(ride, "RIDE_ROW", 2)

    serial, _ = engines
    model = make_target(0).cuda()
    mixed = Engine(model, make_drafter(model, block_size=8, seed=1), backend="fast", max_budget=64, slots=2,
                   pool_slots=8, compile=False)
    mixed.prefill_chunk, mixed.mixed_chunk = 16, True
    mixed.warmup()
    stage = mixed.impl.round_stage()
    shapes = {(1, 4), (1, 8), (4, 2), (1, 16), (8, 2)}
    assert set(stage.riders) == {key[4] for key in stage.graphs} - {0} == shapes
    rides = []
    real_finish = ride.finish
    ride.finish = lambda *a: rides.append((a[1].rows, a[1].chunk)) or real_finish(*a)
    try:
        rng = random.Random(5)
        jobs = [([rng.randrange(64) for _ in range(rng.randrange(1, 30))], spec, rng.randrange(1, 40))
                for _ in range(12)]
        want = [serial.generate(p, GenParams(max_new_tokens=n), s).output_ids for p, s, n in jobs]
        got, _ = _drive(mixed, jobs, running=6)
    finally:
        ride.finish = real_finish
    assert [got[j] for j in range(len(jobs))] == want
    assert any(rows == 1 for rows, _ in rides) and any(rows > 1 for rows, _ in rides)
    gc.collect()
    assert len(mixed.impl._free) == mixed.impl.pool.slots


def test_a_burst_rides_the_prompts_part_in_graphed(engines, monkeypatch):
    """test_chunked_prefill's burst test with graphs: the part-in prompt's chunk rides in the
    burst's graphed round, the joiners' packed prefill is replayed beside it, and all decode as
    serial."""
    serial, _ = engines
    model = make_target(0).cuda()
    engine = Engine(model, make_drafter(model, block_size=8, seed=1), backend="fast", max_budget=64, slots=2,
                    pool_slots=18, compile=False)
    engine.prefill_chunk, engine.mixed_chunk = CHUNK, True
    engine.warmup()
    assert engine.impl.graphs
    burst_beside_a_prompt_part_in(serial, engine, monkeypatch)


def test_ar_rounds_run_ahead_graphed_decode_as_serial(engines):
    """AR rounds replayed one ahead of the host (fast/batch_graph.py): sessions of different
    lengths, one ending on a stop token, a joiner, and the last one alone on its slot's own graphs;
    every device length stays the host's (one more where a round ran ahead) and each output is
    the serial one."""
    from .test_fast_round_ahead import _in_step

    serial, pooled = engines
    assert pooled.round_ahead
    rng = random.Random(11)
    prompts = [[rng.randrange(64) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    lengths = [5, 9, 14, 30, 30, 40]
    plain = [serial.generate(p, GenParams(max_new_tokens=n), SpecParams("ar")).output_ids
             for p, n in zip(prompts, lengths)]
    gens = [GenParams(max_new_tokens=n, stop_token_ids=(plain[3][7],) if i == 3 else ())
            for i, n in enumerate(lengths)]
    want = [serial.generate(p, g, SpecParams("ar")).output_ids for p, g in zip(prompts, gens)]
    counts = dict(pooled.impl.round_stage().ahead_counts)
    sessions = [pooled.start(p, g, SpecParams("ar")) for p, g in zip(prompts[:5], gens[:5])]
    turn = 0
    while not all(s.done for s in sessions) or len(sessions) < 6:
        if turn == 6:
            sessions.append(pooled.start(prompts[5], gens[5], SpecParams("ar")))
        live = [s for s in sessions if not s.done]
        pooled.step_many(live)
        _in_step(pooled, sessions)
        turn += 1
    assert [s.output_ids for s in sessions] == want
    now = pooled.impl.round_stage().ahead_counts
    assert now["taken"] - counts["taken"] > 10 and now["dropped"] - counts["dropped"] <= 1  # the last one alone
    gc.collect()
    assert len(pooled.impl._free) == pooled.impl.pool.slots
