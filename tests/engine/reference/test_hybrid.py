"""Targets with recurrent layers (Qwen3-Next, Qwen3.5 style): the builtin engine decodes them with
ar only, exactly, and refuses dflash/ddtree before any output (their recurrent state would take in
rejected draft nodes)."""

import json
import subprocess

import pytest
import torch

from ddtree.engine.arch import builtin_refusal, hybrid_reason, read_config
from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.errors import BadParams

from ...support.server import CLI, SERVER, ServerProcess
from .conftest import make_drafter

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256,
             tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def qwen3_next(seed: int = 0):
    import transformers

    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip("this transformers has no Qwen3-Next")
    cfg = transformers.Qwen3NextConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32)
    return _built(transformers.Qwen3NextForCausalLM, cfg, seed)


def qwen3_5(seed: int = 0):
    import transformers

    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3.5")
    return _built(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**SMALL), seed)


def _built(cls, cfg, seed):
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # sharper logits: greedy ties vanishingly rare
    return model


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain decoding by full recompute: no cache at all."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 3]]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request):
    model = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5}[request.param]()
    assert "linear_attention" in model.config.layer_types
    return model


def test_speculative_algorithms_are_refused_with_the_reason(hybrid):
    engine = Engine(hybrid, make_drafter(hybrid, block_size=8))
    assert engine.hybrid_reason and "linear_attention" in engine.hybrid_reason
    for spec in (SpecParams("dflash"), SpecParams("ddtree", 4), SpecParams("ddtree", 32)):
        with pytest.raises(BadParams) as info:
            engine.start([1, 2, 3], GenParams(max_new_tokens=8), spec)
        text = str(info.value)
        assert "\n" not in text and spec.algorithm in text and "linear_attention" in text
        assert "rejected" in text and "rolled back" in text
        assert "SGLang" in text and "--mamba-scheduler-strategy extra_buffer" in text


@pytest.mark.slow
def test_ar_equals_plain_decoding_alone_and_stepped_together(hybrid):
    engine = Engine(hybrid, make_drafter(hybrid, block_size=8))
    gen = GenParams(max_new_tokens=16, ignore_eos=True)
    want = [_greedy(hybrid, p, 16) for p in PROMPTS]
    for prompt, ref in zip(PROMPTS, want):
        assert engine.generate(prompt, gen, SpecParams("ar")).output_ids == ref
        assert engine.generate(prompt, gen, SpecParams("ddtree", 0)).output_ids == ref  # budget 0 is ar
    # A server steps its sessions together: on a recurrent target that must not batch them.
    sessions = [engine.start(p, gen, SpecParams("ar")) for p in PROMPTS]
    while not all(s.done for s in sessions):
        engine.step_many([s for s in sessions if not s.done])
    assert [s.output_ids for s in sessions] == want
    with pytest.raises(BadParams):
        engine.step_many([sessions[0], sessions[0]])


def test_detection_reads_config_objects_and_config_json_dicts():
    from transformers import Qwen3Config

    assert hybrid_reason(Qwen3Config(num_hidden_layers=2)) is None
    assert hybrid_reason({"model_type": "qwen3", "num_hidden_layers": 2}) is None
    assert hybrid_reason(None) is None
    next_json = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}
    assert hybrid_reason(next_json) == "qwen3_next has recurrent layers (linear_attention)"
    # Qwen3.5 (multimodal): the language model's layout sits in text_config
    wrapped = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
                                                        "layer_types": ["linear_attention", "full_attention"]}}
    assert "linear_attention" in hybrid_reason(wrapped)
    assert "linear_num_value_heads" in hybrid_reason({"model_type": "x", "linear_num_value_heads": 8})
    assert builtin_refusal(next_json, "ar") is None
    assert builtin_refusal(next_json, "ddtree", 0) is None
    assert "refuses ddtree" in builtin_refusal(next_json, "ddtree", 16)
    assert "refuses dflash" in builtin_refusal(next_json, "dflash")
    assert builtin_refusal({"model_type": "llama"}, "ddtree", 16) is None


def test_load_refuses_a_speculative_default_before_loading_weights(tmp_path, hybrid):
    target_dir = tmp_path / "target"
    hybrid.save_pretrained(target_dir)
    assert "linear_attention" in hybrid_reason(read_config(target_dir))
    from ddtree.engine.reference.drafter import save_drafter

    draft_dir = save_drafter(make_drafter(hybrid, block_size=8), tmp_path / "drafter")
    with pytest.raises(BadParams, match="refuses ddtree"):
        Engine.load(target_dir, draft_dir, algorithm="ddtree", budget=None)
    engine = Engine.load(target_dir, draft_dir, algorithm="ar")
    assert engine.generate([1, 2, 3], GenParams(max_new_tokens=6, ignore_eos=True),
                           SpecParams("ar")).output_ids == _greedy(hybrid, [1, 2, 3], 6)


def test_read_config_without_network(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "layer_types": ["mamba"]}))
    assert read_config(tmp_path)["model_type"] == "qwen3_next"
    assert read_config(tmp_path / "missing") is None
    assert read_config(None) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert read_config(tmp_path / "bad") is None


def _served_pair(tmp_path, model):
    """A hybrid target folder with the demo's tokenizer (the server's warm-up encodes text), and a drafter."""
    import shutil

    from ddtree.engine.demo import demo_paths
    from ddtree.engine.reference.drafter import save_drafter

    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_paths()[0] / name, target_dir / name)
    return target_dir, save_drafter(make_drafter(model, block_size=4), tmp_path / "drafter")


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory):
    import transformers

    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip("this transformers has no Qwen3-Next")
    cfg = transformers.Qwen3NextConfig(**{**SMALL, "vocab_size": 4096}, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return _served_pair(tmp_path_factory.mktemp("served"), _built(transformers.Qwen3NextForCausalLM, cfg, 3))


@pytest.mark.slow
def test_serve_refuses_a_speculative_default_with_one_line(served_pair):
    target, drafter = served_pair
    for argv in ([*CLI, "serve"], SERVER):  # before exec (config.json only), and the server itself
        out = subprocess.run([*argv, "--model", str(target), "--draft", str(drafter), "--port", "0"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "refuses ddtree" in last and "extra_buffer" in last
        assert out.stdout == ""  # never announced itself
    out = subprocess.run([*CLI, "serve", "--model", str(target), "--draft", str(drafter), "--algorithm", "dflash"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "refuses dflash" in out.stderr


@pytest.mark.slow
def test_serve_with_algorithm_ar_starts(served_pair, tmp_path):
    target, drafter = served_pair
    proc = ServerProcess([*CLI, "serve", "--model", str(target), "--draft", str(drafter), "--algorithm", "ar",
                          "--port", "0", "--threads", "1"], tmp_path / "server.log")
    assert proc.stop(60) == 0, proc.log_tail()
