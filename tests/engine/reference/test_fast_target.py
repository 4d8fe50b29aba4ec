"""The fast backend's target equals target.Target on the same checkpoint, call for call.

Tiny random Qwen3 / Llama / Qwen2 models are saved with transformers and loaded both ways; every
round a Session does (prefill, one-token step, tree verify, chain verify, compact) is compared.
"""

import json
import shutil

import pytest
import torch

from ddtree.engine.reference.errors import BadParams, ModelLoadError
from ddtree.engine.reference.fast.cache import StaticKVCache
from ddtree.engine.reference.fast.model import DecoderConfig, unsupported_reason
from ddtree.engine.reference.fast.target import FastTarget, bucket_sizes, load_fast_target
from ddtree.engine.reference.target import Target
from ddtree.engine.reference.tree import build_tree, chain_tree, tree_attention_mask

DEMO_TARGET = __import__("pathlib").Path(__file__).resolve().parents[3] / "assets" / "demo" / "target"
TOL = {"atol": 1e-4, "rtol": 1e-4}
SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


def _build(kind: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen3":  # q/k norms, transformers 5.x rope_parameters, linear RoPE scaling
        cfg = Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
        model = Qwen3ForCausalLM(cfg)
    elif kind == "llama":  # every bias, llama3 RoPE
        cfg = LlamaConfig(**SMALL, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                          rope_theta=50000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = LlamaForCausalLM(cfg)
    else:  # q/k/v biases, tied embeddings
        cfg = Qwen2Config(**SMALL, tie_word_embeddings=True, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():  # sharper logits and visible biases, so differences would show
        model.model.embed_tokens.weight.mul_(2.0)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.mul_(4.0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (transformers model, its saved directory). Qwen2 is saved sharded; Llama without head_dim."""
    out = {}
    for seed, kind in enumerate(("qwen3", "llama", "qwen2")):
        model = _build(kind, seed)
        directory = tmp_path_factory.mktemp(kind)
        model.save_pretrained(directory, max_shard_size="40KB" if kind == "qwen2" else "50GB")
        if kind == "llama":
            path = directory / "config.json"
            raw = json.loads(path.read_text())
            raw.pop("head_dim", None)
            path.write_text(json.dumps(raw))
        out[kind] = (model, directory)
    assert (out["qwen2"][1] / "model.safetensors.index.json").is_file()
    return out


def _leaf_path(tree) -> list[int]:
    """Node indices root..deepest-latest leaf: a path whose rows must move on compaction."""
    leaf = max(range(tree.size), key=lambda i: (int(tree.depths[i]), i))
    keep = [leaf]
    while keep[0] != 0:
        keep.insert(0, int(tree.parents[keep[0]]))
    return keep


def _session_rounds(target, vocab: int, seed: int, *, additive: bool = False) -> list:
    """The calls one DDTree session makes, on any target; returns every ForwardOut (and lengths)."""
    g = torch.Generator().manual_seed(seed)
    dev = target.device

    def t(values):
        return torch.as_tensor(values, dtype=torch.long).to(dev)

    context = torch.randint(0, vocab, (9,), generator=g).to(dev)
    outs = []
    with torch.inference_mode():
        cache = target.new_cache()
        outs.append(target.forward(context, t(range(9)), cache, features=True))
        outs.append(target.forward(context[-1:], t([9]), cache, features=True))
        start = 10
        outs.append(target.forward(context[:3], t(range(start, start + 3)), cache, last_only=True))
        cache.crop(start)  # a verify's rows, dropped again
        logprobs = torch.log_softmax(torch.randn(5, vocab, generator=g) * 3, -1).to(dev)
        tree = build_tree(int(context[0]), logprobs, 20)
        assert not tree.is_chain
        if isinstance(target, Target):
            mask = tree_attention_mask(tree, start, target.dtype)
        elif additive:
            mask = tree_attention_mask(tree, start, target.dtype)
        else:
            mask = target.tree_mask(tree, start)
        outs.append(target.forward(tree.tokens, tree.depths + start, cache, mask, features=True))
        keep = _leaf_path(tree)
        assert keep != list(range(len(keep)))
        cache.compact(start, t(keep), keep)
        start += len(keep)
        outs.append(cache.seq_length())
        chain = chain_tree(int(context[1]), torch.randint(0, vocab, (4,), generator=g).to(dev))
        outs.append(target.forward(chain.tokens, chain.depths + start, cache, features=True))
        cache.compact(start, t([0, 1, 2]), [0, 1, 2])  # contiguous: no rows move
        start += 3
        outs.append(cache.seq_length())
        outs.append(target.forward(context[2:3], t([start]), cache, features=True))
    return outs


def _assert_same(got: list, want: list, **tol) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, int):
            assert a == b, f"round {i}: cache length {a} != {b}"
            continue
        torch.testing.assert_close(a.logits, b.logits, **tol, msg=lambda m: f"round {i} logits: {m}")
        if b.features is None:
            assert a.features is None
        else:
            assert a.features.dtype == b.features.dtype
            torch.testing.assert_close(a.features, b.features, **tol, msg=lambda m: f"round {i} features: {m}")


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
def test_fast_target_matches_transformers_round_for_round(saved, kind):
    model, directory = saved[kind]
    layers = (0, 1, 2)  # the last one is the normed final state, as in transformers' hidden_states
    fast = load_fast_target(directory, dtype=torch.float32, feature_layers=layers, context_window=64)
    vocab = model.config.vocab_size
    want = _session_rounds(Target(model, layers), vocab, seed=7)
    _assert_same(_session_rounds(fast, vocab, seed=7), want, **TOL)
    # The static padded path (the one CUDA graphs capture) gives the same numbers, on both kernels.
    for attention in ("sdpa", "matmul"):
        static = FastTarget(fast.model, layers, context_window=64, max_query=32, static=True,
                            attention=attention)
        _assert_same(_session_rounds(static, vocab, seed=7), want, **TOL)
    _assert_same(_session_rounds(static, vocab, seed=7, additive=True), want, **TOL)
    eager = FastTarget(fast.model, layers, context_window=64, attention="matmul")
    _assert_same(_session_rounds(eager, vocab, seed=7), want, **TOL)


def test_loaded_parameters_follow_the_checkpoint(saved):
    model, directory = saved["qwen2"]
    fast = load_fast_target(directory, dtype=torch.float32)
    assert fast.model.lm_head.weight is fast.model.model.embed_tokens.weight  # tied, not copied
    names = dict(fast.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(names[name], p, atol=0, rtol=0)
    assert fast.config.model_type == "qwen2" and fast.config.num_hidden_layers == 3
    assert fast.vocab_size == 96 and fast.hidden_size == 64 and fast.num_layers == 3
    llama = load_fast_target(saved["llama"][1], dtype=torch.float32)
    assert llama.cfg.head_dim == 16 and llama.cfg.o_bias and llama.cfg.mlp_bias


def test_demo_target_matches_transformers():
    from transformers import AutoModelForCausalLM

    layers = (1, 4, 7)
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    fast = load_fast_target(DEMO_TARGET, dtype=torch.float32, feature_layers=layers, context_window=128,
                            max_query=32)
    want = _session_rounds(Target(model, layers), fast.vocab_size, seed=3)
    _assert_same(_session_rounds(fast, fast.vocab_size, seed=3), want, **TOL)
    static = FastTarget(fast.model, layers, context_window=128, max_query=32, static=True, attention="matmul")
    _assert_same(_session_rounds(static, fast.vocab_size, seed=3), want, **TOL)


def test_static_cache_bookkeeping():
    cache = StaticKVCache(2, 1, 4, 10, slack=8, dtype=torch.float32)
    assert cache.rows == 64 and cache.nbytes() == 2 * 2 * 64 * 4 * 4
    cache.k[:, :, :12] = torch.arange(12.0)[None, None, :, None]
    cache.set_length(12)
    cache.compact(5, torch.tensor([0, 2, 5]), [0, 2, 5])
    assert cache.seq_length() == 8 and int(cache.length_t) == 8
    assert cache.k[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 10]
    cache.crop(20)
    assert cache.seq_length() == 8
    cache.crop(3)
    assert cache.seq_length() == 3 and int(cache.length_t) == 3
    with pytest.raises(Exception, match="compact"):
        cache.compact(2, torch.tensor([0, 4]), [0, 4])


def test_buckets_masks_and_bad_calls(saved):
    assert bucket_sizes(1) == (1,) and bucket_sizes(33) == (1, 2, 3, 5, 9, 17, 33)
    assert bucket_sizes(34) == (1, 2, 3, 5, 9, 17, 33, 65) and bucket_sizes(2) == (1, 2)
    fast = load_fast_target(saved["qwen3"][1], dtype=torch.float32, context_window=16, max_query=8)
    chain = chain_tree(3, torch.tensor([4, 5]))
    assert fast.tree_mask(chain, 0) is None
    cache = fast.new_cache()
    assert cache.slack == 9 and cache.rows >= 25  # max_query 8 pads to bucket 9
    with torch.inference_mode():
        with pytest.raises(BadParams, match="attention_mask"):
            fast.forward(torch.tensor([1, 2]), torch.arange(2), cache, torch.ones(2, 3, dtype=torch.bool))
        with pytest.raises(BadParams, match="CUDA"):
            fast.capture(cache)
    assert fast.attention == "sdpa"  # auto on a CPU
    with pytest.raises(BadParams, match="attention"):
        FastTarget(fast.model, attention="flash")
        with pytest.raises(Exception, match="KV cache full"):
            fast.forward(torch.zeros(cache.rows + 1, dtype=torch.long), torch.arange(cache.rows + 1), cache)


def _rewrite(directory, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    shutil.copytree(directory, out)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "missing: model.layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"model.norm.weight": torch.ones(65)}), r"wrong shape: model.norm.weight \(65,\)"),
    (lambda s: s.update({"model.layers.0.self_attn.extra": torch.ones(2)}),
     "unexpected: model.layers.0.self_attn.extra"),
    (lambda s: s.pop("lm_head.weight"), "missing: lm_head.weight"),
])
def test_mismatched_checkpoints_are_refused_with_the_names(saved, tmp_path, edit, message):
    directory = _rewrite(saved["qwen3"][1], tmp_path, edit)
    with pytest.raises(ModelLoadError, match=message):
        load_fast_target(directory, dtype=torch.float32)


def test_unsupported_model_type_and_missing_files(saved, tmp_path):
    out = tmp_path / "gemma"
    shutil.copytree(saved["qwen3"][1], out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "model_type": "gemma2"}))
    with pytest.raises(ModelLoadError, match="gemma2"):
        load_fast_target(out, dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_fast_target(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_fast_target(tmp_path / "empty")


BASE = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


@pytest.mark.parametrize("change, words", [
    ({"model_type": "qwen3_next"}, "qwen3_next"),
    ({"layer_types": ["full_attention", "linear_attention"] * 2}, "linear_attention"),
    ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}, "sliding"),
    ({"model_type": "mistral"}, "sliding"),  # transformers' Mistral default window is 4096
    ({"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 2}, "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
    ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"hidden_act": "swish2"}, "swish2"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unsupported_reason_names_the_cause(change, words):
    config = {**BASE, **change}
    reason = unsupported_reason(config)
    assert reason is not None and words in reason and "\n" not in reason
    with pytest.raises(ModelLoadError, match=words):
        DecoderConfig.from_dict(config)


def test_supported_configs_and_both_rope_layouts():
    assert unsupported_reason(BASE) is None
    assert unsupported_reason({**BASE, "model_type": "mistral", "sliding_window": None}) is None
    assert unsupported_reason({**BASE, "model_type": "qwen2", "use_sliding_window": False,
                               "sliding_window": 4096}) is None
    old = DecoderConfig.from_dict({**BASE, "model_type": "llama", "rope_theta": 5e5,
                                   "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = DecoderConfig.from_dict({**BASE, "model_type": "llama",
                                   "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert old == new and old.rope_type == "linear" and old.rope_scaling == {"factor": 2.0}
    assert old.head_dim == 16 and not old.qk_norm and not old.tie_word_embeddings
    qwen2 = DecoderConfig.from_dict({**BASE, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias
    assert DecoderConfig.from_dict(BASE).qk_norm


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_cuda_graph_replays_equal_the_static_path_and_transformers(attention):
    from transformers import AutoModelForCausalLM

    class Graphed(FastTarget):
        def new_cache(self):
            cache = super().new_cache()
            self.capture(cache)
            return cache

    layers = (1, 4, 7)
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).to("cuda").eval()
    fast = load_fast_target(DEMO_TARGET, device="cuda", dtype=torch.float32, feature_layers=layers,
                            context_window=128, max_query=32)
    kwargs = {"context_window": 128, "max_query": 32, "attention": attention}
    graphed = _session_rounds(Graphed(fast.model, layers, **kwargs), fast.vocab_size, seed=3)
    static = _session_rounds(FastTarget(fast.model, layers, static=True, **kwargs), fast.vocab_size, seed=3)
    _assert_same(graphed, static, atol=1e-5, rtol=1e-5)
    want = _session_rounds(Target(model, layers), fast.vocab_size, seed=3)
    _assert_same(graphed, want, atol=2e-3, rtol=2e-3)
