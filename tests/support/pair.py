"""The tests' tiny random models: a Qwen3 target and a DFlash drafter, in memory or saved with a
small byte-level BPE tokenizer as a pair of model folders (what the server and the sweep load).

torch and transformers are imported inside the functions, so importing this module costs nothing
for the tests that never build a model.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    # As Qwen3's: a variable only chat_template_kwargs set, so tests can see them reach the template.
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)
CONTEXT_WINDOW = 512


def make_target(seed: int = 0, *, vocab: int = 64, layers: int = 4, hidden: int = 64, attn: str = "sdpa",
                scale: float = 4.0, embed_scale: float | None = None, max_pos: int = 512,
                eos: int | None = None):
    """A random Qwen3 in float32 (4 heads, 2 KV heads). `scale` sharpens the logits so greedy ties
    are vanishingly rare; the embeddings grow by `embed_scale` (scale / 2 unless given)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=max_pos, tie_word_embeddings=False,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None, rope_theta=10000.0)
    cfg._attn_implementation = attn
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.model.embed_tokens.weight.mul_(scale / 2 if embed_scale is None else embed_scale)
    return model


def make_drafter(target, *, block_size: int = 8, seed: int = 1, layers: int = 1, mask_token_id: int | None = None,
                 max_pos: int | None = None):
    """A random DFlash drafter for `target`; mask token the last id of the vocab unless given."""
    import torch

    from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter

    cfg = target.config
    n = cfg.num_hidden_layers
    ids = (1, n - 2)[:layers] if layers > 1 else (n // 2,)
    mask = cfg.vocab_size - 1 if mask_token_id is None else mask_token_id
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=cfg.vocab_size, num_target_layers=n, target_layer_ids=ids,
                        mask_token_id=mask, block_size=block_size, rope_theta=10000.0,
                        **({} if max_pos is None else {"max_position_embeddings": max_pos}))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg).float().eval()
    with torch.no_grad():  # wider weights than the init so drafts vary with the context
        drafter.fc.weight.mul_(10)
    return drafter


def build_tokenizer(directory: Path) -> int:
    """A byte-level BPE (vocab 384) trained on two stdlib modules' source, with the Qwen specials
    and a chat template, saved into `directory`; returns its vocab size."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = inspect.getsource(json_module) + inspect.getsource(inspect)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS, IM_START, IM_END, MASK]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for t in specials}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "eos_token": EOS,
        "pad_token": EOS, "mask_token": MASK, "model_max_length": CONTEXT_WINDOW,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


def build_tiny_pair(root: Path, *, hidden: int = 64, layers: int = 4, block_size: int = 4) -> tuple[Path, Path]:
    """root/target (a random Qwen3 with the tokenizer) and root/drafter (a 1-layer DFlash drafter
    trained, so to speak, with blocks of `block_size`), saved the way real checkpoints are."""
    from ddtree.engine.reference.drafter import save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    vocab = build_tokenizer(target_dir)
    # Sharp logits (x20) so greedy outputs are not near-ties; EOS is token 0, the tokenizer's.
    target = make_target(0, vocab=vocab, layers=layers, hidden=hidden, scale=20.0, embed_scale=1.0,
                         max_pos=CONTEXT_WINDOW, eos=0)
    target.save_pretrained(target_dir)
    save_drafter(make_drafter(target, block_size=block_size, mask_token_id=3, max_pos=CONTEXT_WINDOW), drafter_dir)
    return target_dir, drafter_dir
