"""The training objective of train_demo matches what the decoders do at inference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from ddtree.engine.reference.train_demo import (  # noqa: E402
    SeqSet, accept_lengths, block_batch, block_mask, drafter_forward, lr_at, pick_anchors)


def _tiny_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


def _tiny_drafter(block: int) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=64, num_target_layers=4,
                       target_layer_ids=(1, 3), mask_token_id=3, block_size=block)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg)
    # Larger weights than the init, so a wrong mask or position shows in the outputs.
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return drafter.eval()


def test_many_anchor_pass_equals_one_block_at_a_time():
    block = 4
    target, drafter = _tiny_target(), _tiny_drafter(block)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 64, (2, 30), generator=g)
    anchors = torch.tensor([[5, 12, 20], [9, 3, 26]])
    batched = drafter_forward(drafter, target, tokens, anchors, 3, block, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        hidden = target(input_ids=tokens, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1] for i in (1, 3)], dim=-1)
        embed = target.get_input_embeddings()
        for b in range(2):
            for j, a in enumerate(anchors[b].tolist()):
                ids = torch.full((1, block), 3)
                ids[0, 0] = tokens[b, a]
                pos = torch.arange(a + block)[None]
                # Inference: the context is every committed position before the bonus, no mask.
                out = drafter(embed(ids), feats[b:b + 1, :a], pos)
                logits = target.get_output_embeddings()(out)[0]
                torch.testing.assert_close(batched[b, j], logits, atol=2e-4, rtol=1e-4)


def test_block_mask_shape_and_pattern():
    mask = block_mask(torch.tensor([[2, 5]]), 6, 3, torch.float32)
    assert mask.shape == (1, 1, 6, 12)
    allowed = mask[0, 0] == 0
    assert allowed[0, :6].tolist() == [True, True, False, False, False, False]
    assert allowed[3, :6].tolist() == [True] * 5 + [False]
    assert allowed[0, 6:].tolist() == [True] * 3 + [False] * 3
    assert allowed[4, 6:].tolist() == [False] * 3 + [True] * 3


def test_anchors_stay_in_the_generated_region_and_labels_follow():
    tokens = torch.arange(40).repeat(3, 1)
    s = SeqSet(tokens, gen_start=torch.tensor([10, 20, 5]), valid_end=torch.tensor([40, 30, 9]))
    g = torch.Generator().manual_seed(0)
    idx = torch.arange(3)
    anchors, ok = pick_anchors(s, idx, 4, 4, g, full_blocks=True)
    for b in range(3):
        for a, good in zip(anchors[b].tolist(), ok[b].tolist()):
            if good:
                assert s.gen_start[b] - 1 <= a <= s.valid_end[b] - 4
    assert ok[:2].all()
    assert ok[2].sum() == 2  # anchors 4..5 only: a full block must end by valid_end
    labels, live = block_batch(s, idx, anchors, 4)
    assert torch.equal(labels[:, :, 0], anchors)
    assert torch.equal(labels[:, :, 3], anchors + 3)


def test_accept_lengths_count_the_leading_run_plus_the_bonus():
    labels = torch.tensor([[[9, 1, 2, 3]]])
    logits = torch.zeros(1, 1, 4, 5)
    for i, t in enumerate([0, 1, 2, 4]):
        logits[0, 0, i, t] = 1.0
    assert accept_lengths(logits, labels).item() == 3


def test_schedule_warms_up_then_decays():
    assert lr_at(0, 100, 10, 1.0) == pytest.approx(0.1)
    assert lr_at(10, 100, 10, 1.0) == pytest.approx(1.0)
    assert lr_at(99, 100, 10, 1.0) < 0.12
