"""Packed prefills on CUDA in half precision (fast/prefill.py): the varlen flash kernel that a
graph replays, fed by rope_write, gives what a loop over the prompts gives with the norms, RoPE and
cache writes as separate ops, and the padding leaves the pool finite.
Skipped without CUDA; fp32 (the loop) is covered by test_cuda_pool's rounds."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.engine import Engine
from ddtree.engine.reference.fast import prefill

from .test_fast_engine import DEMO_DRAFTER, DEMO_TARGET

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_varlen_kernel_and_its_graph_agree_with_a_loop_over_the_prompts():
    if not (DEMO_TARGET / "config.json").is_file():
        pytest.skip("the demo pair is not built")
    engine = Engine.load(DEMO_TARGET, DEMO_DRAFTER, device="cuda", dtype=torch.bfloat16, backend="fast",
                         max_budget=16, pool_slots=8)
    stage = engine.impl.prefill_stage()
    assert stage.packed_kernel
    pool = engine.impl.pool
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 37, 5, 120, 16)]
    slots = [4, 0, 2, 7, 3]
    with torch.inference_mode():
        size, counts = stage.stage(prompts, slots)
        assert size == 192 and counts == (1, 37, 5, 120, 16, 13)
        varlen = [None if t is None else t.clone() for t in prefill.prefill_static(engine, stage, size)]
        rows = [pool.k[:, s, :, :len(p)].clone() for p, s in zip(prompts, slots)]
        stage.packed_kernel = False
        loop = [None if t is None else t.clone() for t in prefill.prefill_static(engine, stage, size, counts)]
        # The loop without rope_write too: the norms, RoPE and writes as separate ops, so the fused
        # kernel's keys and values (which flash reads) are checked against another path. Those ops
        # round to bfloat16 after each step where the kernel rounds once, so logits near 10 may
        # differ by an ulp or two (0.0625 each) there.
        attns = [layer.self_attn for layer in engine.target.model.model.layers]
        for attn in attns:
            attn.fused_writes = False
        unfused = prefill.prefill_static(engine, stage, size, counts)[0].clone()
        loop_rows = [pool.k[:, s, :, :len(p)].clone() for p, s in zip(prompts, slots)]
        for attn in attns:
            attn.fused_writes = True
        stage.packed_kernel = True
        graph, logits, feats = prefill.capture(engine, stage, size)
        pool.k.zero_()
        graph.replay()
        torch.cuda.synchronize()
    n = len(prompts)
    # bfloat16 through every layer: a logit near 0 may move by several of its ulps where the two
    # attention kernels round apart (an H100 saw 3 of 20480 logits move by 0.07), so the check
    # is against the logits' scale, with the mean difference far below it.
    scale = varlen[0][:n].abs().mean()
    torch.testing.assert_close(varlen[0][:n], loop[0][:n], atol=0.1, rtol=0.02)
    assert (loop[0][:n] - varlen[0][:n]).abs().mean() < 0.005 * scale
    torch.testing.assert_close(unfused[:n], varlen[0][:n], atol=0.25, rtol=0.05)
    assert (unfused[:n] - varlen[0][:n]).abs().mean() < 0.01 * scale
    if varlen[1] is not None:  # the demo drafter's feature layers: bf16 hidden states, rounded
        # apart the same way (an H100 saw 13 of 183296 values 0.05-0.09 apart)
        got, want = varlen[1][:size - 13], loop[1][:size - 13]
        torch.testing.assert_close(got, want, atol=0.15, rtol=0.02)
        assert (got - want).abs().mean() < 0.01 * want.abs().mean()
    # The replay runs the same kernels on the same inputs.
    torch.testing.assert_close(logits[:n], varlen[0][:n], atol=1e-3, rtol=0)
    for p, s, want, other in zip(prompts, slots, rows, loop_rows):
        torch.testing.assert_close(pool.k[:, s, :, :len(p)], want, atol=1e-3, rtol=0)
        torch.testing.assert_close(other, want, atol=0.25, rtol=0.05)  # unfused: rounded per op
    assert pool.k.isfinite().all() and pool.v.isfinite().all()
    assert (pool.k[:, slots[0], :, stage.scratch_row] != 0).any()  # the padding's row


def test_a_turns_staging_never_waits_for_the_gpu():
    """A prefill's inputs and a round's rows go up from pinned memory without a stream sync, so
    a round staged behind a queued prefill does not wait for it (fast/graphs.py Staging); a plain
    copy from pageable memory would (the check fails on one)."""
    from ddtree.engine.reference.fast.graphs import Staging

    if not (DEMO_TARGET / "config.json").is_file():
        pytest.skip("the demo pair is not built")
    engine = Engine.load(DEMO_TARGET, DEMO_DRAFTER, device="cuda", dtype=torch.bfloat16, backend="fast",
                         max_budget=16, pool_slots=8)
    stage, rounds = engine.impl.prefill_stage(), engine.impl.round_stage()
    buf = torch.zeros(64, dtype=torch.long, device="cuda")
    staging = Staging(buf)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            buf.copy_(torch.arange(64))  # pageable: a sync, which the mode refuses
        for k in range(3):
            staging.write()[:] = torch.arange(64) + k
            staging.upload()
        with torch.inference_mode():
            stage.stage([[5, 6, 7], [8, 9]], [1, 0])
        rounds.stage_rows([True, False] * 4, list(range(8)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert buf.tolist() == list(range(2, 66))
    assert stage.ids[:5].tolist() == [5, 6, 7, 8, 9] and stage.slots[:5].tolist() == [1, 1, 1, 0, 0]
    assert rounds.active.tolist() == [True, False] * 4 and rounds.cap.tolist() == list(range(8))
