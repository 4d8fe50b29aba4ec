"""Launch specs for each engine kind, algorithm, tp and GPU set, against recorded SGLang builds."""

from __future__ import annotations

import json
import shlex

import pytest

from ddtree.engine.serving.launch import LaunchSpec, build_launch, free_port
from ddtree.engine.serving.probe import (LaunchConfigError, UnsupportedAlgorithmError, UnsupportedFlagError,
                                 capabilities_from_help)
from .engine_fakes import ddtree_help, recorded_help

PY = "/opt/sglang/bin/python"
CAPS = {
    "0.5.23": capabilities_from_help("sglang", PY, "0.5.23", recorded_help("0.5.23")),
    "0.5.11": capabilities_from_help("sglang", PY, "0.5.11", recorded_help("0.5.11")),
    "ddtree": capabilities_from_help("sglang", PY, "0.5.23.dev29907", ddtree_help()),
}
VLLM = capabilities_from_help("vllm", PY, "0.33.0",
                              "usage: vllm serve\n\noptions:\n  --tensor-parallel-size TP, -tp TP\n"
                              "  --host HOST\n  --port PORT\n  --speculative-config SC, -sc SC\n"
                              "  --max-model-len MAX_MODEL_LEN\n",
                              frozenset({"dflash", "eagle3"}))
TABLE = {"kind": "sglang", "python": PY, "model": "moonshotai/Kimi-K2.6", "draft_model": "z-lab/Kimi-K2.6-DFlash",
         "block_size": 8, "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "numa_bind": "off",
         "extra_args": ["--attention-backend", "fa3"], "env": {"SGLANG_LOG_LEVEL": "info"}}

no_tools = lambda name: None  # noqa: E731


def launch(table=None, caps="0.5.23", **kw):
    args = dict(algorithm="dflash", budget=None, tp=8, gpus=list(range(8)), port=31000, which=no_tools)
    args.update(kw)
    return build_launch(table or TABLE, caps=CAPS[caps] if isinstance(caps, str) else caps, **args)


def test_dflash_on_0_5_23_is_the_command_an_operator_types():
    spec = launch()
    assert spec.argv == (PY, "-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2.6", "--tp-size", "8",
                         "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                         "z-lab/Kimi-K2.6-DFlash", "--speculative-num-draft-tokens", "8",
                         "--host", "127.0.0.1", "--port", "31000", "--enable-metrics", "--attention-backend", "fa3")
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SGLANG_LOG_LEVEL": "info"}
    assert spec.base_url == "http://127.0.0.1:31000" and spec.health_url.endswith("/health")
    assert spec.api == "generate" and spec.metrics_path == "/metrics" and spec.engine_version == "0.5.23"
    line = spec.command_line()
    assert line.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 SGLANG_LOG_LEVEL=info /opt/sglang/bin/python -m")
    assert shlex.split(line)[2:] == list(spec.argv)
    assert json.loads(json.dumps(spec.to_dict()))["command"] == line


def test_ar_has_no_speculative_flags_and_ignores_budget():
    spec = launch(algorithm="ar", budget=32, tp=4, gpus=[4, 5, 6, 7])
    assert not [a for a in spec.argv if a.startswith("--speculative")]
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "--tp-size" in spec.argv
    assert spec.argv[spec.argv.index("--tp-size") + 1] == "4"
    assert any("ignored" in n for n in spec.notes) and spec.budget is None


def test_ddtree_refused_on_release_builds():
    for caps in ("0.5.23", "0.5.11"):
        with pytest.raises(UnsupportedAlgorithmError) as err:
            launch(algorithm="ddtree", budget=64, caps=caps)
        assert "has no DDTREE" in str(err.value) and "use algorithm dflash" in err.value.hint
        assert err.value.exit_code == 2


def test_ddtree_on_a_ddtree_build():
    spec = launch(algorithm="ddtree", budget=64, caps="ddtree")
    argv = list(spec.argv)
    assert argv[argv.index("--speculative-algorithm") + 1] == "DDTREE"
    assert argv[argv.index("--speculative-ddtree-budget") + 1] == "64"
    assert argv[argv.index("--page-size") + 1] == "1"
    assert spec.budget == 64
    with pytest.raises(LaunchConfigError):
        launch(algorithm="ddtree", budget=None, caps="ddtree")


def test_old_release_uses_its_own_flag_names():
    table = dict(TABLE, draft_window=2048)
    old = launch(table, caps="0.5.11")
    new = launch(table, caps="0.5.23")
    assert "--speculative-dflash-draft-window-size" in old.argv and "--speculative-draft-window-size" not in old.argv
    assert "--speculative-draft-window-size" in new.argv


def test_extra_args_checked_against_the_build():
    with pytest.raises(UnsupportedFlagError) as err:
        launch(dict(TABLE, extra_args=["--speculative-dspark-block-size", "4"]), caps="0.5.11")
    assert "not accepted by SGLang 0.5.11" in str(err.value)
    assert launch(dict(TABLE, extra_args=["--mem-fraction-static=0.8"]))
    with pytest.raises(LaunchConfigError) as err:
        launch(dict(TABLE, extra_args=["--port", "30000"]))
    assert "manages" in str(err.value)


def test_dflash_needs_draft_and_model():
    with pytest.raises(LaunchConfigError):
        launch(dict(TABLE, draft_model=None))
    with pytest.raises(LaunchConfigError):
        launch(dict(TABLE, model=None))


def test_tp_must_match_gpus_and_port_must_be_concrete():
    with pytest.raises(LaunchConfigError):
        launch(tp=4, gpus=[0, 1])
    with pytest.raises(LaunchConfigError):
        launch(port=0)
    with pytest.raises(LaunchConfigError):
        launch(tp=0, gpus=[])


def test_hybrid_target_gets_the_mamba_strategy_where_the_flag_exists(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "layer_types": ["linear_attention", "linear_attention", "full_attention"]}}))
    table = dict(TABLE, model=str(tmp_path))
    old = launch(table, caps="0.5.11")
    assert old.argv[old.argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    assert "--mamba-scheduler-strategy" not in launch(table, caps="0.5.23").argv  # derived there
    assert any("collapses" in n for n in launch(table, caps="ddtree", algorithm="ddtree", budget=16).notes)


@pytest.mark.parametrize("tools,how,prefix", [
    ({"numactl", "taskset"}, "numactl", ["numactl", "--cpunodebind=1", "--membind=1"]),
    ({"taskset"}, "taskset", ["taskset", "-c", "16-23,48-55"]),
    (set(), "runner", []),
])
def test_numa_binding(tools, how, prefix):
    cpus = list(range(16, 24)) + list(range(48, 56))
    spec = launch(dict(TABLE, numa_bind="auto"), tp=4, gpus=[4, 5, 6, 7], numa_node=1, numa_cpus=cpus,
                  which=lambda name: f"/usr/bin/{name}" if name in tools else None)
    assert spec.numa == how
    assert list(spec.argv[:len(prefix)]) == prefix and spec.argv[len(prefix)] == PY
    assert spec.cpu_affinity == (tuple(cpus) if how == "runner" else ())


def test_numa_auto_without_topology_pins_nothing():
    spec = launch(dict(TABLE, numa_bind="auto"))
    assert spec.numa == "unknown" and spec.argv[0] == PY and spec.notes


def test_vllm_dflash():
    spec = launch(dict(TABLE, kind="vllm", extra_args=["--max-model-len", "8192"]), caps=VLLM, tp=2, gpus=[0, 1])
    argv = list(spec.argv)
    assert argv[:6] == [PY, "-m", "vllm.entrypoints.cli.main", "serve", "moonshotai/Kimi-K2.6",
                        "--tensor-parallel-size"]
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "dflash", "model": "z-lab/Kimi-K2.6-DFlash", "num_speculative_tokens": 7}
    assert spec.api == "openai" and argv[-2:] == ["--max-model-len", "8192"]
    with pytest.raises(UnsupportedAlgorithmError):
        launch(dict(TABLE, kind="vllm"), caps=VLLM, algorithm="ddtree", budget=8)
    assert "--speculative-config" not in launch(dict(TABLE, kind="vllm", extra_args=[]), caps=VLLM,
                                                algorithm="ar").argv


def test_builtin_launch_from_a_recipe_engine_spec():
    from ddtree.jobs.recipe import EngineSpec  # the sweep runner passes its dataclass as is

    spec = build_launch(EngineSpec(kind="builtin", python="/usr/bin/python3", algorithm="ddtree", block_size=8,
                                   env=(("OMP_NUM_THREADS", "2"),), backend="fast"),
                        algorithm="ddtree", budget=32, tp=1, gpus=[], port=0)
    assert spec.argv == ("/usr/bin/python3", "-m", "ddtree.engine.reference.server", "--algorithm", "ddtree",
                         "--budget", "32", "--block-size", "8", "--device", "cpu", "--backend", "fast",
                         "--host", "127.0.0.1", "--port", "0")
    plain = build_launch({"kind": "builtin"}, algorithm="ar", budget=None, tp=1, gpus=[], port=0).argv
    assert plain[plain.index("--backend") + 1] == "auto"
    assert spec.announces_url and spec.base_url is None and spec.env == {"OMP_NUM_THREADS": "2"}
    with pytest.raises(LaunchConfigError):
        build_launch({"kind": "builtin"}, algorithm="ar", budget=None, tp=2, gpus=[], port=0)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_builtin_backend_is_refused_for_other_engines(kind):
    caps = VLLM if kind == "vllm" else "0.5.23"
    with pytest.raises(LaunchConfigError, match="engine.backend applies to the builtin engine only"):
        launch(dict(TABLE, kind=kind, backend="fast"), caps=caps)
    assert "--backend" not in launch(dict(TABLE, kind=kind, backend="auto", extra_args=[]), caps=caps).argv


def test_launch_spec_validates():
    with pytest.raises(LaunchConfigError):
        LaunchSpec(kind="sglang", argv=(), port=1)
    with pytest.raises(LaunchConfigError):
        LaunchSpec(kind="sglang", argv=("x",), port=0)
    with pytest.raises(LaunchConfigError):
        LaunchSpec(kind="tgi", argv=("x",), port=1)
    port = free_port()
    assert 0 < port < 65536
