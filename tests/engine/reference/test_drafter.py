import json

import pytest
import torch

from ddtree.engine.reference.drafter import (
    DFlashConfig,
    DFlashDrafter,
    context_features,
    default_target_layer_ids,
    load_drafter,
    save_drafter,
)
from ddtree.engine.reference.errors import ModelLoadError

# The shape of a real z-lab checkpoint's config.json (z-lab/Qwen3-8B-DFlash-b16), scaled down.
ZLAB_STYLE = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 96,
    "max_position_embeddings": 40960,
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "num_key_value_heads": 2,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def small_config(**over) -> DFlashConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=50, num_target_layers=6, target_layer_ids=(1, 3),
                mask_token_id=49, block_size=4)
    base.update(over)
    return DFlashConfig(**base)


def test_zlab_config_round_trips_with_its_keys():
    cfg = DFlashConfig.from_dict(ZLAB_STYLE)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.mask_token_id == 151669 and cfg.block_size == 16 and cfg.num_target_layers == 36
    out = cfg.to_dict()
    for key, value in ZLAB_STYLE.items():
        if key == "dflash_config":
            assert out[key]["target_layer_ids"] == value["target_layer_ids"]
            assert out[key]["mask_token_id"] == value["mask_token_id"]
        else:
            assert out[key] == value, key
    assert DFlashConfig.from_dict(out) == cfg
    with_name = dict(ZLAB_STYLE, dflash_config=dict(ZLAB_STYLE["dflash_config"], mask_token="<|MASK|>"))
    assert DFlashConfig.from_dict(with_name).to_dict()["dflash_config"]["mask_token"] == "<|MASK|>"


def test_weight_names_are_the_zlab_layout():
    names = set(DFlashDrafter(small_config()).state_dict())
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        want |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        want |= {f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        want |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert names == want


def test_default_target_layers():
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    cfg = dict(ZLAB_STYLE, dflash_config={"mask_token_id": 7})
    assert DFlashConfig.from_dict(cfg).target_layer_ids == (1, 9, 17, 25, 33)


def test_layer_ids_and_mask_token_are_read_at_the_top_level_too():
    # Some published DFlash configs put both at the top level instead of in dflash_config.
    top = {k: v for k, v in ZLAB_STYLE.items() if k != "dflash_config"}
    top.update(target_layer_ids=[2, 10, 18, 26, 34], mask_token_id=151669)
    cfg = DFlashConfig.from_dict(top)
    assert cfg.target_layer_ids == (2, 10, 18, 26, 34) and cfg.mask_token_id == 151669
    assert "target_layer_ids" not in cfg.extra and "mask_token_id" not in cfg.extra
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg  # written back in dflash_config
    # the same value in both places is fine; different values are refused, naming both
    both = dict(ZLAB_STYLE, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669)
    assert DFlashConfig.from_dict(both) == DFlashConfig.from_dict(ZLAB_STYLE)
    with pytest.raises(ModelLoadError) as info:
        DFlashConfig.from_dict(dict(ZLAB_STYLE, target_layer_ids=[2, 10, 18, 26, 34]))
    text = str(info.value)
    assert "\n" not in text and "[1, 9, 17, 25, 33]" in text and "[2, 10, 18, 26, 34]" in text
    with pytest.raises(ModelLoadError, match="151669.*7|7.*151669"):
        DFlashConfig.from_dict(dict(ZLAB_STYLE, mask_token_id=7))


@pytest.mark.parametrize("bad", [dict(target_layer_ids=(6,)), dict(target_layer_ids=()), dict(block_size=1),
                                 dict(num_key_value_heads=3), dict(mask_token_id=50), dict(hidden_size=0),
                                 dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})])
def test_bad_configs_are_named_errors(bad):
    with pytest.raises(ModelLoadError):
        small_config(**bad)


def test_save_load_round_trip_and_forward(tmp_path):
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_config()).eval()
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["mask_token_id"] == 49
    loaded = load_drafter(tmp_path)
    x, h = torch.randn(2, 4, 32), torch.randn(2, 5, 64)
    pos = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, h, pos), drafter(x, h, pos))
    bf16 = load_drafter(tmp_path, dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(bf16(x.bfloat16(), h.bfloat16(), pos).float(), drafter(x, h, pos),
                                   atol=0.1, rtol=0.05)


def test_load_lists_every_mismatch(tmp_path):
    from safetensors.torch import save_file

    drafter = DFlashDrafter(small_config())
    save_drafter(drafter, tmp_path)
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    del state["norm.weight"]
    state["fc.weight"] = torch.zeros(3, 3)
    state["lm_head.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_drafter(tmp_path)
    text = str(err.value)
    assert "missing: norm.weight" in text and "unexpected: lm_head.weight" in text and "fc.weight (3, 3)" in text


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="lacks"):
        load_drafter(tmp_path)


def test_context_cache_equals_one_shot():
    """Feeding the context in two rounds through the draft cache equals one full pass."""
    torch.manual_seed(1)
    drafter = DFlashDrafter(small_config()).eval()
    x, h = torch.randn(1, 4, 32), torch.randn(1, 7, 64)
    with torch.no_grad():
        full = drafter(x, h, torch.arange(11)[None])
        cache = drafter.new_cache()
        drafter(torch.randn(1, 4, 32), h[:, :3], torch.tensor([[0, 1, 2, 3, 4, 5, 6]]), None, cache)
        assert cache.get_seq_length() == 3  # block rows are never cached
        split = drafter(x, h[:, 3:], torch.arange(3, 11)[None], None, cache)
        assert cache.get_seq_length() == 7
    torch.testing.assert_close(split, full, atol=1e-5, rtol=1e-5)


def test_no_causal_mask_inside_the_block_and_mask_argument():
    torch.manual_seed(2)
    drafter = DFlashDrafter(small_config()).eval()
    x, h = torch.randn(1, 4, 32), torch.randn(1, 3, 64)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        base = drafter(x, h, pos)
        x2 = x.clone()
        x2[:, 3] += 1.0  # the last block row is visible to the first
        assert not torch.allclose(drafter(x2, h, pos)[:, 0], base[:, 0])
        zero_mask = torch.zeros(1, 1, 4, 7)
        torch.testing.assert_close(drafter(x, h, pos, zero_mask), base)
        hide = zero_mask.clone()
        hide[..., 6] = torch.finfo(torch.float32).min
        assert torch.allclose(drafter(x2, h, pos, hide)[:, 0], drafter(x, h, pos, hide)[:, 0], atol=1e-6)


def test_context_features_pick_entry_id_plus_one():
    states = tuple(torch.full((1, 2, 3), float(i)) for i in range(6))
    feats = context_features(states, (0, 3))
    assert feats.shape == (1, 2, 6)
    assert feats[0, 0].tolist() == [1, 1, 1, 4, 4, 4]


def test_matches_the_qwen3_reference_math():
    """Our layer equals transformers' Qwen3 pieces wired the DFlash way (k/v over context+block)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    torch.manual_seed(3)
    cfg = small_config(num_hidden_layers=1, rope_theta=10000.0)
    drafter = DFlashDrafter(cfg).eval()
    att = drafter.layers[0].self_attn
    x, h = torch.randn(1, 4, 32), torch.randn(1, 3, 64)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        ctx = drafter.hidden_norm(drafter.fc(h))
        xn = drafter.layers[0].input_layernorm(x)
        q = att.q_norm(att.q_proj(xn).view(1, 4, 4, 8)).transpose(1, 2)
        kv_in = torch.cat((ctx, xn), 1)
        k = att.k_norm(att.k_proj(kv_in).view(1, 7, 2, 8)).transpose(1, 2)
        v = att.v_proj(kv_in).view(1, 7, 2, 8).transpose(1, 2)
        inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
        freqs = pos[0, :, None].float() * inv
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[None], emb.sin()[None]
        qr, _ = apply_rotary_pos_emb(q, q, cos[:, 3:], sin[:, 3:])
        _, kr = apply_rotary_pos_emb(k, k, cos, sin)
        kr, v = kr.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        attn = torch.softmax(qr @ kr.transpose(-1, -2) * 8 ** -0.5, -1) @ v
        y = x + att.o_proj(attn.transpose(1, 2).reshape(1, 4, 32))
        y = y + drafter.layers[0].mlp(drafter.layers[0].post_attention_layernorm(y))
        want = drafter.norm(y)
        torch.testing.assert_close(drafter(x, h, pos), want, atol=1e-5, rtol=1e-5)
    ref_norm = Qwen3RMSNorm(32, eps=1e-6)
    t = torch.randn(2, 32)
    torch.testing.assert_close(drafter.norm(t), ref_norm(t))
