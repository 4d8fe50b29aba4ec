"""VRAM fit estimate: weights from safetensors headers (parsed without torch), KV per token from
config.json, per GPU at a tp size; and `ddtree-console hw --fit`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from ddtree.engine.machine.preflight import (PreflightError, estimate_vram, kv_layout, read_safetensors_header,
                                     safetensors_weights)

from ...support.cli import run_hw

QWEN3_8B = {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_size": 4096, "torch_dtype": "bfloat16"}
KIMI_K2 = {"model_type": "kimi_k2", "num_hidden_layers": 61, "num_attention_heads": 64, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "hidden_size": 7168, "torch_dtype": "bfloat16"}


def tiny_model(folder, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"embed": np.zeros((100, 16), np.float16), "norm": np.zeros(16, np.float32)},
              str(folder / "model-00001-of-00002.safetensors"))
    save_file({"lm_head": np.zeros((100, 16), np.float16), "step": np.zeros(3, np.int64)},
              str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    cfg = config or {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16,
                     "torch_dtype": "float16"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_weights_come_from_the_headers_not_file_sizes(tmp_path):
    model = tiny_model(tmp_path / "m")
    info = safetensors_weights(model)
    assert info.params == 100 * 16 * 2 + 16 + 3
    assert info.dtypes == {"F16": 2 * 100 * 16 * 2, "F32": 64, "I64": 24}
    assert info.bytes == 6400 + 64 + 24 and info.files == 2
    on_disk = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    assert on_disk > info.bytes  # headers and alignment are not weights
    assert read_safetensors_header(model / "model-00002-of-00002.safetensors")["__metadata__"] == {"format": "pt"}


def test_bad_safetensors_files_are_named_errors(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    (tmp_path / "huge.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    (tmp_path / "junk.safetensors").write_bytes((4).to_bytes(8, "little") + b"nope")
    (tmp_path / "list.safetensors").write_bytes((2).to_bytes(8, "little") + b"[]")
    for name, words in [("short", "shorter"), ("huge", "header length"), ("junk", "not JSON"),
                        ("list", "not a JSON object")]:
        with pytest.raises(PreflightError) as err:
            read_safetensors_header(tmp_path / f"{name}.safetensors")
        assert words in str(err.value) and err.value.exit_code == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    header = json.dumps({"w": {"dtype": "F16", "shape": "x", "data_offsets": [0, 2]}}).encode()
    (bad / "w.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    with pytest.raises(PreflightError, match="malformed"):
        safetensors_weights(bad)
    with pytest.raises(PreflightError, match="a file, not a model directory"):
        safetensors_weights(tmp_path / "list.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PreflightError, match="no weight files"):
        safetensors_weights(empty)


def test_unknown_dtype_uses_data_offsets(tmp_path):
    header = json.dumps({"q": {"dtype": "F4", "shape": [10, 4], "data_offsets": [0, 20]}}).encode()
    (tmp_path / "q.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 20)
    info = safetensors_weights(tmp_path)
    assert info.bytes == 20 and info.params == 40


def test_kv_per_token_gqa_and_mla():
    qwen = kv_layout(QWEN3_8B)
    assert qwen.bytes_per_token == 36 * 8 * 128 * 2 * 2 == 147456
    assert qwen.per_gpu_per_token(2) == 147456 / 2
    assert qwen.per_gpu_per_token(16) == 147456 / 8  # 8 kv heads on 16 GPUs: one head each, replicated
    assert kv_layout(QWEN3_8B, kv_dtype_bytes=1).bytes_per_token == 73728
    no_head_dim = {k: v for k, v in QWEN3_8B.items() if k not in ("head_dim", "num_key_value_heads")}
    assert kv_layout(no_head_dim).bytes_per_token == 36 * 32 * 128 * 2 * 2
    kimi = kv_layout(KIMI_K2)
    assert kimi.mla and kimi.bytes_per_token == 61 * (512 + 64) * 2
    assert kimi.per_gpu_per_token(8) == kimi.bytes_per_token  # the latent is on every GPU
    nested = kv_layout({"model_type": "vlm", "text_config": QWEN3_8B})
    assert nested.bytes_per_token == qwen.bytes_per_token
    with pytest.raises(PreflightError, match="num_hidden_layers"):
        kv_layout({"hidden_size": 8})
    with pytest.raises(PreflightError, match="KV dtype"):
        kv_layout(QWEN3_8B, kv_dtype_bytes=3)


def test_estimate_against_gpus(tmp_path):
    model = tiny_model(tmp_path / "m")
    draft = tiny_model(tmp_path / "d")
    per_token = 2 * 2 * 4 * 2 * 2  # layers x kv heads x head_dim(16/4) x K,V x fp16
    est = estimate_vram(model, [100_000, 100_000], 2, context=100, concurrency=4, draft_dir=draft, mem_fraction=0.5)
    assert est.kv.bytes_per_token == per_token and est.kv_bytes == per_token * 400
    assert est.weights_bytes == 2 * 6488 and est.per_gpu_weights == 6488
    assert est.per_gpu_kv == per_token * 400 / 2
    assert est.per_gpu_budget == 50_000 and est.fits
    assert est.max_tokens == (50_000 - 6488) // (per_token / 2)
    assert not estimate_vram(model, [10_000], 1, context=1000, concurrency=4).fits
    assert "does NOT fit" in estimate_vram(model, [10_000], 1, context=1000).describe()
    with pytest.raises(PreflightError, match="tp 4 needs 4 GPUs"):
        estimate_vram(model, [1, 1], 4)
    with pytest.raises(PreflightError, match="context"):
        estimate_vram(model, [1], 1, context=0)
    with pytest.raises(PreflightError, match="no config.json"):
        (model / "config.json").unlink() or estimate_vram(model, [10**9], 1)


def test_hw_fit_cli(tmp_path):
    model = tiny_model(tmp_path / "m")
    rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "0.0001", "--tp", "2", "--context", "64",
                      "--concurrency", "2"])
    assert rc == 0, out
    assert "VRAM fit:" in out and "2 x 0.0001 GB (given)" in out and "fits" in out and "KiB/token" in out
    rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "0.0001", "--json"])
    data = json.loads(out)
    assert data["weights"]["bytes"] == 6488 and data["kv"]["bytes_per_token"] == 64 and data["tp"] == 1
    rc, out = run_hw(["--fit", str(tmp_path / "nope"), "--gpu-mem-gb", "1"])
    assert rc == 2 and "does not exist" in out
    # a missing folder is the error, not the GPUs there are none of to fit it on
    rc, out = run_hw(["--from", str(_no_gpus_report(tmp_path)), "--fit", str(tmp_path / "nope")])
    assert rc == 2 and "does not exist" in out and "GPU" not in out
    rc, out = run_hw(["--context", "10"])
    assert rc == 2 and "go with --fit" in out
    # the default value given out loud is no different: without --fit it would be ignored
    for extra in (["--context", "8192"], ["--concurrency", "1"]):
        rc, out = run_hw(extra)
        assert rc == 2 and "go with --fit" in out, extra


def _no_gpus_report(tmp_path):
    report = tmp_path / "hw.json"
    report.write_text(json.dumps({"gpus": [], "links": [], "reason": "no NVIDIA driver"}))
    return report


def test_hw_fit_uses_the_gpus_of_a_report(tmp_path):
    model = tiny_model(tmp_path / "m")
    rc, out = run_hw(["--from", str(_no_gpus_report(tmp_path)), "--fit", str(model)])
    assert rc == 2 and "tp 1 needs 1 GPU: no GPUs here" in out and "--gpu-mem-gb" in out


def test_fit_path_does_not_import_torch(tmp_path):
    model = tiny_model(tmp_path / "m")
    code = ("import sys; from ddtree.engine.machine.preflight import estimate_vram; "
            f"estimate_vram({str(model)!r}, [10**9]); assert 'torch' not in sys.modules "
            "and 'safetensors' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("argv, words", [
    (["--context", "99999999999999999999"], "context must be 1..16,777,216 tokens, got 99999999999999999999"),
    (["--concurrency", "1048577"], "concurrency must be 1..1,048,576, got 1048577"),
    (["--tp", "99999999999"], "--tp must be 1..1024, got 99999999999"),  # once a MemoryError building the GPU list
    (["--tp", "0"], "--tp must be 1..1024, got 0"),
])
def test_hw_fit_refuses_impossible_sizes(tmp_path, argv, words):
    model = tiny_model(tmp_path / "m")
    assert run_hw(["--fit", str(model), "--gpu-mem-gb", "80", *argv]) == (2, f"error: {words}")


def test_hw_fit_warns_when_tp_cannot_split_the_kv_heads(tmp_path):
    """The tiny model has 2 KV heads: tp 2 splits them, tp 4 gives each head two GPUs, tp 3 is what
    SGLang and vLLM refuse; the estimate still prints (the launch path does not refuse it either)."""
    model = tiny_model(tmp_path / "m")
    for tp in ("2", "4"):
        rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "80", "--tp", tp])
        assert rc == 0 and "note:" not in out
    rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "80", "--tp", "3"])
    assert rc == 0 and "VRAM fit:" in out
    # its 4 attention heads do not split over 3 GPUs either: both reasons, attention heads first
    assert out.splitlines()[-2].startswith("  note: tp 3 cannot split 4 attention heads evenly")
    assert out.splitlines()[-1].startswith("  note: tp 3 cannot split 2 KV heads evenly")
    rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "80", "--tp", "3", "--json"])
    notes = json.loads(out)["notes"]
    assert len(notes) == 2 and notes[1].startswith("tp 3 cannot split 2 KV heads evenly")
    mla = kv_layout(KIMI_K2)
    assert mla.tp_split_problem(3) is None  # one latent, replicated on every GPU


def test_hw_fit_warns_when_tp_cannot_split_the_attention_heads(tmp_path):
    """6 attention heads over 2 KV heads: tp 4 gives each KV head two GPUs (fine for the KV cache) but
    cannot shard 6 query heads, which SGLang and vLLM refuse; said as the KV-heads case is said."""
    model = tiny_model(tmp_path / "m", {"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
                                        "head_dim": 8, "hidden_size": 16, "torch_dtype": "float16"})
    for tp in ("2", "6"):
        rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "80", "--tp", tp])
        assert rc == 0 and "note:" not in out
    rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "80", "--tp", "4"])
    assert rc == 0 and "VRAM fit:" in out
    assert out.splitlines()[-1] == ("  note: tp 4 cannot split 6 attention heads evenly (SGLang and vLLM need tp "
                                    "to divide them), so a server refuses this tp; the figures assume it could")
    rc, out = run_hw(["--fit", str(model), "--gpu-mem-gb", "80", "--tp", "4", "--json"])
    data = json.loads(out)
    assert data["kv"]["attention_heads"] == 6
    assert len(data["notes"]) == 1 and data["notes"][0].startswith("tp 4 cannot split 6 attention heads evenly")
    # MLA: the latent is replicated, but the 64 query heads are still sharded
    mla = kv_layout(KIMI_K2)
    assert mla.tp_problems(8) == [] and mla.tp_split_problem(3) is None
    assert mla.tp_problems(3) == [mla.tp_attention_problem(3)]
    assert "64 attention heads" in mla.tp_attention_problem(3)
