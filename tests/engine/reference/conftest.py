"""Tiny models built on the fly (tests/support/pair.py, imported from here by this folder's
tests), and drafter test doubles."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.drafter import DraftCache

from ...support.pair import make_drafter, make_target  # noqa: F401  (this folder's tests import them from here)


class _CountingCache(DraftCache):
    def __init__(self) -> None:
        super().__init__(1)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length


class OracleDrafter(torch.nn.Module):
    """A drafter double that proposes the target's own greedy continuation.

    It reads the session's committed tokens (set `.session` after Engine.start), runs the target
    greedily for block_size-1 steps and returns the target's final hidden states, so the draft
    distribution at each block position is the target's own (sharpened by `sharpen`). With
    `noise` > 0 a random perturbation makes some drafts wrong, so paths end early and branch.
    """

    def __init__(self, target, block_size: int, *, sharpen: float = 50.0, noise: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__()
        self.target = [target]  # a list, so the target's parameters are not ours
        self.config = make_drafter(target, block_size=block_size).config
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.sharpen = sharpen
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed)
        self.session = None

    block_size = property(lambda self: self.config.block_size)
    target_layer_ids = property(lambda self: self.config.target_layer_ids)
    mask_token_id = property(lambda self: self.config.mask_token_id)

    def new_cache(self):
        return _CountingCache()

    def forward(self, noise_embeds, target_hidden, position_ids, attention_mask=None, past_key_values=None):
        past_key_values.length += target_hidden.shape[1]
        return self._draft_rows()[None]

    def _draft_rows(self):
        """[block_size, H]: the target's greedy continuation of the session's committed tokens."""
        target = self.target[0]
        seq = list(self.session.prompt_ids) + list(self.session.output_ids)
        hidden = [torch.zeros(target.config.hidden_size)]
        for _ in range(self.block_size - 1):
            h = target.model(torch.tensor([seq])).last_hidden_state[0, -1]
            seq.append(int(target.lm_head(h).argmax()))
            hidden.append(h)
        out = torch.stack(hidden) * self.sharpen
        if self.noise:
            out = out + self.noise * self.sharpen * torch.randn(out.shape, generator=self.gen)
        return out


@pytest.fixture(scope="module")
def tiny_target():
    return make_target(0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP spinning
    # threads that get descheduled make forwards 10x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
