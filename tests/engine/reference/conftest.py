"""Tiny models built on the fly, and drafter test doubles."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, DraftCache


def make_target(seed: int = 0, *, vocab: int = 64, layers: int = 4, hidden: int = 64,
                attn: str = "sdpa", scale: float = 4.0, max_pos: int = 512):
    """A random Qwen3 in float32. `scale` sharpens the logits so greedy ties are vanishingly rare."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=max_pos, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None, rope_theta=10000.0)
    cfg._attn_implementation = attn
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.model.embed_tokens.weight.mul_(scale / 2)
    return model


def make_drafter(target, *, block_size: int = 8, seed: int = 1, layers: int = 1) -> DFlashDrafter:
    cfg = target.config
    n = cfg.num_hidden_layers
    ids = (1, n - 2)[:layers] if layers > 1 else (n // 2,)
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=cfg.vocab_size, num_target_layers=n, target_layer_ids=ids,
                        mask_token_id=cfg.vocab_size - 1, block_size=block_size, rope_theta=10000.0)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg).float().eval()
    with torch.no_grad():  # wider weights than the init so drafts vary with the context
        drafter.fc.weight.mul_(10)
    return drafter


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
