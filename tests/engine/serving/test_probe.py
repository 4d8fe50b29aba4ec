"""Capability probe: recorded --help of real SGLang releases (0.5.11, 0.5.23), a DDTree build,
and the probe running real fake interpreters (subprocesses) with its on-disk cache."""

from __future__ import annotations

import json
import os
import time

import pytest

from ddtree.engine.serving.probe import (Capabilities, LaunchConfigError, ProbeError, capabilities_from_help, probe)

from .engine_fakes import ddtree_help, recorded_help


def caps_for(version: str, text: str | None = None) -> Capabilities:
    return capabilities_from_help("sglang", "/opt/sglang/bin/python", version, text or recorded_help(version))


def test_sglang_0_5_23_free_text_algorithms_and_new_window_flag():
    caps = caps_for("0.5.23")
    assert caps.algorithms == {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO"}
    assert "DDTREE" not in caps.algorithms
    for flag in ("--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--host", "--port",
                 "--enable-metrics", "--speculative-algorithm", "--speculative-draft-model-path",
                 "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
                 "--speculative-draft-window-size", "--page-size",
                 "--no-enable-tf32-matmul"):
        assert caps.has(flag), flag
    assert not caps.has("--speculative-dflash-draft-window-size")  # renamed (alias hidden) by 0.5.23
    assert not caps.has("--speculative-ddtree-budget")
    assert not caps.has("--mamba-scheduler-strategy")  # derived from the model since 0.5.2x
    # Help prose mentions flags in wrapped fragments ("--speculative-"); none may count as a flag.
    assert not any(f.endswith("-") for f in caps.flags)


def test_sglang_0_5_11_choices_and_old_window_flag():
    caps = caps_for("0.5.11")
    assert caps.algorithms == {"DFLASH", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"}
    assert caps.first("--speculative-draft-window-size", "--speculative-dflash-draft-window-size") \
        == "--speculative-dflash-draft-window-size"
    assert caps.first("--tp-size", "--tensor-parallel-size") == "--tp-size"  # alias on the same line


def test_ddtree_build_is_detected():
    caps = caps_for("0.5.23", ddtree_help())
    assert "DDTREE" in caps.algorithms and caps.has("--speculative-ddtree-budget")


def test_budget_flag_alone_implies_ddtree():
    # A plugin may register DDTREE without touching the help of --speculative-algorithm.
    text = recorded_help("0.5.23").replace(
        "  --speculative-dspark-block-size SPECULATIVE_DSPARK_BLOCK_SIZE\n",
        "  --speculative-ddtree-budget SPECULATIVE_DDTREE_BUDGET\n"
        "  --speculative-dspark-block-size SPECULATIVE_DSPARK_BLOCK_SIZE\n", 1)
    assert "DDTREE" in caps_for("0.5.23", text).algorithms


def test_capabilities_round_trip():
    caps = caps_for("0.5.23")
    assert Capabilities.from_dict(json.loads(json.dumps(caps.to_dict()))) == caps


def test_probe_runs_interpreter_once_and_caches_on_disk(fake_python, tmp_path):
    python = fake_python("sglang", ddtree_help(), version="0.5.23+ddtree")
    cache = tmp_path / "data"
    caps = probe("sglang", str(python), cache_dir=cache)
    assert caps.version == "0.5.23+ddtree"
    assert "DDTREE" in caps.algorithms
    stored = json.loads((cache / "engine-probes.json").read_text())
    assert len(stored["probes"]) == 1
    assert (cache / "logs" / "probe-sglang-help.log").exists()

    # Second call in a fresh process state: served from disk; prove it by breaking the help text.
    from ddtree.engine.serving import probe as probe_mod
    probe_mod._MEMO.clear()
    (python.parent.parent / "site" / "sglang" / "help.txt").write_text("garbage")
    again = probe("sglang", str(python), cache_dir=cache)
    assert again == caps

    # Upgrading the package in place (same interpreter, new version) re-probes.
    (python.parent.parent / "site" / "sglang" / "__init__.py").write_text("__version__ = '0.5.24'\n")
    (python.parent.parent / "site" / "sglang" / "help.txt").write_text(recorded_help("0.5.23"))
    probe_mod._MEMO.clear()
    upgraded = probe("sglang", str(python), cache_dir=cache)
    assert upgraded.version == "0.5.24" and "DDTREE" not in upgraded.algorithms


def test_probe_key_changes_with_interpreter_mtime(fake_python, tmp_path):
    python = fake_python("sglang", recorded_help("0.5.11"), version="0.5.11")
    cache = tmp_path / "data"
    probe("sglang", str(python), cache_dir=cache)
    later = time.time() + 10
    os.utime(python, (later, later))
    probe("sglang", str(python), cache_dir=cache)
    assert len(json.loads((cache / "engine-probes.json").read_text())["probes"]) == 2


def test_probe_corrupt_cache_is_ignored(fake_python, tmp_path):
    python = fake_python("sglang")
    cache = tmp_path / "data"
    cache.mkdir()
    (cache / "engine-probes.json").write_text("{not json")
    assert "DFLASH" in probe("sglang", str(python), cache_dir=cache).algorithms


def test_probe_without_sglang_installed(tmp_path):
    import sys

    with pytest.raises(ProbeError) as err:
        probe("sglang", sys.executable, cache_dir=tmp_path)
    assert "import error" in str(err.value)
    assert "engine.python" in err.value.hint


def test_probe_missing_interpreter_is_bad_input(tmp_path):
    with pytest.raises(LaunchConfigError) as err:
        probe("sglang", str(tmp_path / "nope" / "python"))
    assert err.value.exit_code == 2


def test_probe_timeout_kills_the_group(fake_python, tmp_path):
    python = fake_python("sglang", server_body=None)
    launch = python.parent.parent / "site" / "sglang" / "launch_server.py"
    launch.write_text("import time\ntime.sleep(60)\n")
    t0 = time.monotonic()
    with pytest.raises(ProbeError) as err:
        probe("sglang", str(python), cache_dir=tmp_path, timeout_s=1.5)
    assert "did not answer" in str(err.value)
    assert time.monotonic() - t0 < 20


def test_probe_vllm_reads_methods_without_importing(fake_python, tmp_path):
    help_text = ("usage: vllm serve [model_tag] [options]\n\noptions:\n  -h, --help            show this help\n"
                 "\nParallelConfig:\n  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE\n"
                 "                        Number of tensor parallel groups.\n"
                 "\nFrontend:\n  --host HOST           Host name.\n  --port PORT           Port number.\n"
                 "\nSpeculativeConfig:\n  --speculative-config SPECULATIVE_CONFIG, -sc SPECULATIVE_CONFIG\n"
                 "                        Speculative decoding configuration.\n")
    python = fake_python("vllm", help_text, version="0.33.0")
    caps = probe("vllm", str(python), cache_dir=tmp_path)
    assert caps.version == "0.33.0"
    assert "dflash" in caps.algorithms and "eagle3" in caps.algorithms
    assert {"--speculative-config", "-sc", "--tensor-parallel-size", "-tp", "--host", "--port"} <= caps.flags
