import json

import pytest
import torch

from ddtree.engine.demo import DemoMissing, demo_paths
from ddtree.engine.reference.drafter import DFlashConfig, save_drafter
from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.errors import BadParams, ModelLoadError

from .conftest import make_drafter, make_target


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab - 2)] + ["<eos>", "<|MASK|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    model = make_target(21)
    model.config.eos_token_id = 62
    model.save_pretrained(root / "target")
    _tokenizer(64).save_pretrained(root / "target")
    drafter = make_drafter(model, block_size=8)
    save_drafter(drafter, root / "drafter")
    return root / "target", root / "drafter", model


def test_load_from_directories_and_generate(pair):
    target_dir, drafter_dir, model = pair
    engine = Engine.load(target_dir, drafter_dir)
    assert engine.block_size == 8 and engine.max_budget > 0 and engine.context_window == 512
    assert engine.device == "cpu" and engine.eos_token_ids == (62,)
    assert engine.tokenizer is not None and engine.draft_name == str(drafter_dir)
    assert engine.model_name == str(target_dir) and engine.hybrid_warning is None
    ids = engine.tokenizer("w1 w2 w3")["input_ids"]
    assert ids == [1, 2, 3]
    gen = GenParams(max_new_tokens=12, ignore_eos=True)
    ar = engine.generate(ids, gen, SpecParams("ar"))
    dd = engine.generate(ids, gen, SpecParams("ddtree", 16))
    assert ar.output_ids == dd.output_ids
    with torch.no_grad():  # the loaded target is the saved one
        want = model(torch.tensor([ids])).logits[0, -1].argmax()
    assert ar.output_ids[0] == int(want)


def test_eager_attention_and_target_only(pair):
    target_dir, _, _ = pair
    engine = Engine.load(target_dir, attn_implementation="eager")
    assert engine.drafter is None and engine.max_budget == 0 and engine.block_size == 1
    assert engine.generate([1, 2], GenParams(max_new_tokens=3), SpecParams("ar")).output_ids


def test_mask_token_resolved_from_the_tokenizer(pair, tmp_path):
    target_dir, drafter_dir, _ = pair
    raw = json.loads((drafter_dir / "config.json").read_text())
    del raw["dflash_config"]["mask_token_id"]
    raw["dflash_config"]["mask_token"] = "<|MASK|>"
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    (out / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
    assert DFlashConfig.from_dict(raw).mask_token_id is None
    assert Engine.load(target_dir, out).mask_token_id == 63


def test_mismatched_drafter_is_refused(pair, tmp_path):
    target_dir, _, _ = pair
    other = make_target(1, hidden=32)
    save_drafter(make_drafter(other), tmp_path / "d")
    with pytest.raises(ModelLoadError, match="hidden size"):
        Engine.load(target_dir, tmp_path / "d")


def test_a_drafter_given_as_the_target_is_refused_before_any_weight_loads(pair):
    _, drafter_dir, _ = pair
    with pytest.raises(BadParams, match="is a DFlash drafter, not a target"):
        Engine.load(drafter_dir)


def test_a_target_without_a_tokenizer_loads_and_serves_token_ids(pair, tmp_path):
    _, drafter_dir, model = pair
    model.save_pretrained(tmp_path / "bare")
    engine = Engine.load(tmp_path / "bare", drafter_dir)
    assert engine.tokenizer is None
    out = engine.generate([1, 2, 3], GenParams(max_new_tokens=4, ignore_eos=True), SpecParams("ddtree", 4))
    assert len(out.output_ids) == 4


def test_missing_paths_and_bad_options(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Engine.load(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        Engine.load(tmp_path)
    with pytest.raises(ModelLoadError, match="dtype"):
        Engine.load(tmp_path, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(BadParams, match="CUDA"):
            Engine.load(tmp_path, device="cuda")


def test_unknown_hub_id_offline_is_a_clean_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(ModelLoadError, match="cannot fetch") as caught:
        Engine.load("nobody-here/no-such-model")
    # The hub's own message runs over several lines; ours is the CLI's one line.
    assert "\n" not in str(caught.value)


def test_demo_paths(monkeypatch, tmp_path):
    from importlib import resources

    monkeypatch.setattr(resources, "files", lambda pkg: tmp_path)
    with pytest.raises(DemoMissing, match="demo model pair"):
        demo_paths()
    for name in ("target", "drafter"):
        (tmp_path / "demo" / name).mkdir(parents=True)
        (tmp_path / "demo" / name / "config.json").write_text("{}")
    assert demo_paths() == (tmp_path / "demo" / "target", tmp_path / "demo" / "drafter")


def test_demo_pair_defaults_to_float32_on_every_device(tmp_path):
    from ddtree.engine.reference.loading import is_demo_pair, resolve_dtype

    # decided without CUDA: the device string is all the decision reads
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype(None, "cpu") == torch.float32
    for device in ("cpu", "cuda", "cuda:0"):
        assert resolve_dtype(None, device, demo=True) == torch.float32
        assert resolve_dtype("auto", device, demo=True) == torch.float32
    assert resolve_dtype("bfloat16", "cuda", demo=True) == torch.bfloat16  # asked for: honoured
    assert not is_demo_pair(tmp_path)
    try:
        target, _ = demo_paths()
    except DemoMissing:
        return
    assert is_demo_pair(target) and is_demo_pair(target / ".." / "target")
    # A copy elsewhere is still the demo pair (on the H200 a checkout's assets/demo differed in
    # path from the installed package's, and the demo loaded in bf16).
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(target, copy)
    assert is_demo_pair(copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("{", "{\"x\": 1,", 1))
    assert not is_demo_pair(copy)


def test_serve_passes_dtype_through_only_when_asked():
    import argparse

    from ddtree.console.commands import serve

    def argv(*args):
        p = argparse.ArgumentParser()
        serve.add_parser(p.add_subparsers())
        return serve.server_argv(p.parse_args(["serve", *args]))

    assert "--dtype" not in argv()  # auto: the server decides (float32 for the demo pair)
    got = argv("--dtype", "bfloat16")
    assert got[got.index("--dtype") + 1] == "bfloat16"
