"""fast/batch.argmax_rows: the greedy choice at verify rows, made in blocks of rows."""

from types import SimpleNamespace

import torch

from ddtree.engine.reference.fast import batch as fast_batch


def _target(vocab: int, hidden: int, dtype: torch.dtype) -> SimpleNamespace:
    torch.manual_seed(3)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
    return SimpleNamespace(vocab_size=vocab, lm_head=head)


def test_blocks_give_the_one_shot_argmax(monkeypatch):
    target = _target(vocab=50, hidden=16, dtype=torch.float32)
    hidden = torch.randn(23, 16)
    want = target.lm_head(hidden).argmax(dim=-1)
    monkeypatch.setattr(fast_batch, "_LOGIT_ELEMENTS", 50 * 4)  # blocks of 4 rows, the last of 3
    with torch.inference_mode():
        got = fast_batch.argmax_rows(target, hidden)
        index = torch.tensor([22, 0, 5, 5, 17, 9, 1])
        picked = fast_batch.argmax_rows(target, hidden, index)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(picked, want[index])


def test_a_vocabulary_over_the_bound_takes_one_row_at_a_time(monkeypatch):
    target = _target(vocab=40, hidden=8, dtype=torch.float32)
    hidden = torch.randn(5, 8)
    monkeypatch.setattr(fast_batch, "_LOGIT_ELEMENTS", 10)
    with torch.inference_mode():
        assert torch.equal(fast_batch.argmax_rows(target, hidden), target.lm_head(hidden).argmax(dim=-1))


def test_model_dtype_logits_pick_what_their_float32_copy_picks():
    # Ties included: bfloat16 rounds many logits to the same value.
    target = _target(vocab=300, hidden=32, dtype=torch.bfloat16)
    hidden = torch.randn(64, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = target.lm_head(hidden).float().argmax(dim=-1)
        assert torch.equal(fast_batch.argmax_rows(target, hidden), want)
