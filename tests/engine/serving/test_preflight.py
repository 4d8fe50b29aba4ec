"""Model fit and GPU checks before a launch: refusals carry the numbers."""

from __future__ import annotations

import pytest

from ddtree.engine.machine.preflight import (GiB, PreflightError, check_fit, check_gpus, model_weight_bytes, preflight,
                                     require_fit)

H200 = 141 * 10**9


def test_weights_of_a_local_dir(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 24)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert model_weight_bytes(tmp_path) == 1024
    assert model_weight_bytes("moonshotai/Kimi-K2.6", hub_bytes=595 * 10**9) == 595 * 10**9
    assert model_weight_bytes("moonshotai/Kimi-K2.6") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PreflightError) as err:
        model_weight_bytes(empty)
    assert "no weight files" in str(err.value) and err.value.exit_code == 2
    with pytest.raises(PreflightError):
        model_weight_bytes(tmp_path / "missing-dir/")


def test_kimi_fits_on_8_h200_but_not_4():
    assert check_fit(595 * 10**9, [H200] * 8, 8).fits
    report = check_fit(595 * 10**9, [H200] * 4, 4)
    assert not report.fits
    with pytest.raises(PreflightError) as err:
        require_fit(report, "moonshotai/Kimi-K2.6")
    msg = str(err.value)
    assert "595.0 GB over tp 4 = 148.8 GB per GPU" in msg and "124.1 GB (0.88 of 141.0 GB)" in msg
    assert err.value.hint == "use tp 8 or GPUs with more memory"


def test_kv_headroom_is_required():
    # Weights alone fit in 0.88 x 80 GB = 70.4 GB per GPU, but leave < 10% of it for the KV cache.
    report = check_fit(2 * 66 * 10**9, [80 * 10**9] * 2, 2)
    assert report.per_gpu_kv > 0 and not report.fits


def test_preflight_sums_target_and_drafter(tmp_path):
    target, draft = tmp_path / "t", tmp_path / "d"
    target.mkdir(), draft.mkdir()
    (target / "m.safetensors").write_bytes(b"\0" * 700)
    (draft / "m.safetensors").write_bytes(b"\0" * 300)
    assert preflight(str(target), str(draft), [2000], 1).weights_bytes == 1000
    with pytest.raises(PreflightError):
        preflight(str(target), str(draft), [1000], 1)
    assert preflight("org/unknown", None, [1000], 1) is None


def test_gpu_checks():
    check_gpus([0, 1, 2, 3, 4, 5, 6, 7], 4)
    with pytest.raises(PreflightError) as err:
        check_gpus([0, 1, 2, 3, 4, 5], 4)
    assert "does not divide" in str(err.value) and "[1, 2, 3, 6]" in err.value.hint
    with pytest.raises(PreflightError) as err:
        check_gpus([0, 1], 2, used_bytes={0: 512 * 1024**2, 1: 60 * GiB}, processes={1: 1})
    assert "GPU 1 (64.4 GB used, 1 process)" in str(err.value) and "GPU 0" not in str(err.value)
    with pytest.raises(PreflightError) as err:
        check_gpus([0, 9], 2, visible=[0, 1, 2, 3])
    assert "GPU 9 does not exist" in str(err.value)
