"""The plan: launches (argv, env), restart logic, point order, keys, estimate, JSON shape."""

import json

from ddtree.jobs.plan import format_plan, make_plan, point_key
from ddtree.jobs.recipe import parse_recipe

BUILTIN = """
name = "demo"
[engine]
model = "/m/target"
draft_model = "/m/drafter"
[sweep]
budget = [4, 8]
concurrency = [2, 1]
num_prompts = 8
max_new_tokens = 16
baseline = ["ar", "dflash"]
repeats = 2
"""


def test_builtin_engine_takes_spec_per_request_so_one_launch():
    plan = make_plan(parse_recipe(BUILTIN))
    assert len(plan.launches) == 1
    launch = plan.launches[0]
    argv = list(launch.argv)
    assert argv[1:3] == ["-m", "ddtree.engine.reference.server"]
    assert argv[argv.index("--model") + 1] == "/m/target" and argv[argv.index("--draft") + 1] == "/m/drafter"
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--budget") + 1] == "8"
    # concurrency ascending (saturation stops a series early), baselines before the measured grid,
    # repeats interleaved (A B C A B C) so drift lands on every spec alike
    order = [(p.concurrency, p.algorithm, p.budget, p.repeat) for p in plan.points]
    assert order[:8] == [(1, "ar", None, 0), (1, "dflash", None, 0), (1, "ddtree", 4, 0), (1, "ddtree", 8, 0),
                         (1, "ar", None, 1), (1, "dflash", None, 1), (1, "ddtree", 4, 1), (1, "ddtree", 8, 1)]
    assert len(plan.points) == 16 and all(p.launch == 0 for p in plan.points)
    assert len({p.key for p in plan.points}) == 16
    assert [p.baseline for p in plan.points[:4]] == [True, True, False, False]


def test_repeats_back_to_back_when_interleave_is_off_and_the_plan_says_which():
    recipe = parse_recipe(BUILTIN + "interleave = false\n")
    order = [(p.algorithm, p.budget, p.repeat) for p in make_plan(recipe).points[:4]]
    assert order == [("ar", None, 0), ("ar", None, 1), ("dflash", None, 0), ("dflash", None, 1)]
    data = make_plan(recipe).to_dict()
    assert data["repeats"]["order"] == "grouped" and data["repeats"]["count"] == 2
    text = format_plan(make_plan(parse_recipe(BUILTIN)))
    assert "repeats: 2 per point, interleaved across algorithms and budgets (A B C A B C)" in text
    assert "warm-up: 2 requests before each point, not measured" in text
    single = format_plan(make_plan(parse_recipe(BUILTIN.replace("repeats = 2", "repeats = 1"))))
    assert "repeats: 1 per point (no interval" in single


def test_builtin_launch_carries_the_recipe_backend_into_the_dry_run():
    from ddtree.jobs.plan import format_plan

    argv = list(make_plan(parse_recipe(BUILTIN)).launches[0].argv)
    assert argv[argv.index("--backend") + 1] == "auto"  # the default, said out loud
    plan = make_plan(parse_recipe(BUILTIN.replace('draft_model = "/m/drafter"',
                                                  'draft_model = "/m/drafter"\nbackend = "transformers"')))
    argv = list(plan.launches[0].argv)
    assert argv[argv.index("--backend") + 1] == "transformers"
    assert "--backend transformers" in format_plan(plan)
    assert plan.to_dict()["launches"][0]["argv"] == argv


def test_server_side_axes_restart_the_engine_for_engines_that_fix_them():
    recipe = parse_recipe("""
name = "s"
[engine]
kind = "sglang"
model = "/m/target"
python = "/nonexistent/python"
gpus = [0, 1, 2, 3]
[sweep]
budget = [16, 32]
tp = [2, 4]
concurrency = [1, 8]
baseline = ["ar"]
""")
    plan = make_plan(recipe)
    # per tp: ar baseline, ddtree 16, ddtree 32 -> 3 launches each
    got = [(l.tp, l.algorithm, l.budget, dict(l.env)["CUDA_VISIBLE_DEVICES"]) for l in plan.launches]
    assert got == [(2, "ar", None, "0,1"), (2, "ddtree", 16, "0,1"), (2, "ddtree", 32, "0,1"),
                   (4, "ar", None, "0,1,2,3"), (4, "ddtree", 16, "0,1,2,3"), (4, "ddtree", 32, "0,1,2,3")]
    # client-side axes reuse the launch: both concurrencies under each
    for launch in plan.launches:
        assert [p.concurrency for p in plan.points if p.launch == launch.index] == [1, 8]
    # an interpreter that is not there: every launch says so instead of a command
    assert all(l.argv is None and "/nonexistent/python does not exist" in l.unsupported for l in plan.launches)


def test_plan_json_shape_and_estimate():
    plan = make_plan(parse_recipe(BUILTIN))
    data = json.loads(json.dumps(plan.to_dict()))
    assert set(data) == {"name", "engine_kind", "engine", "launches", "points", "warnings", "repeats", "estimate",
                         "box"}
    assert data["engine"] is None  # builtin: nothing probed
    assert set(data["launches"][0]) >= {"index", "argv", "env", "tp", "gpus", "algorithm", "budget", "est_start_s"}
    point = data["points"][0]
    assert set(point) >= {"index", "launch", "key", "algorithm", "budget", "concurrency", "dataset", "temperature",
                          "repeat", "baseline", "est_s"}
    assert data["estimate"]["total_s"] > 0
    assert abs(sum(p["est_s"] for p in data["points"]) + data["launches"][0]["est_start_s"]
               - data["estimate"]["total_s"]) < 1.0
    # num_prompts 8 < 5 x 2, but not < 5 x 1
    assert any("5 x concurrency 2" in w for w in data["warnings"])
    assert not any("5 x concurrency 1:" in w for w in data["warnings"])
    # measured speed halves the estimate when it doubles
    faster = make_plan(parse_recipe(BUILTIN), stream_tok_s=2 * plan.assumed_stream_tok_s)
    assert sum(p.est_s for p in faster.points) == sum(p.est_s for p in plan.points) / 2


def test_point_key_is_stable_across_types():
    params = {"engine_kind": "builtin", "algorithm": "ddtree", "budget": 8, "tp": 1, "gpus": (), "concurrency": 1,
              "dataset": "builtin:code", "temperature": 0, "repeat": 0}
    assert point_key(params) == point_key({**params, "temperature": 0.0, "gpus": []})


def _hybrid_recipe(tmp_path, sweep: str) -> str:
    """A recipe on a target whose config.json has linear-attention layers (no weights needed)."""
    target = tmp_path / "next"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "layer_types": ["linear_attention", "linear_attention", "full_attention"]}))
    drafter = tmp_path / "drafter"  # a local model path must exist (check_plan refuses it otherwise)
    drafter.mkdir(exist_ok=True)
    return f'name = "h"\n[engine]\nmodel = "{target}"\ndraft_model = "{drafter}"\n[sweep]\n{sweep}\n'


def test_builtin_plan_refuses_speculative_algorithms_on_a_hybrid_target(tmp_path):
    import pytest

    from ddtree.jobs.plan import UnsupportedEngine, check_plan, format_plan

    plan = make_plan(parse_recipe(_hybrid_recipe(tmp_path, 'budget = [4, 8]\nbaseline = ["ar"]')))
    launch = plan.launches[0]
    assert launch.argv is None and "refuses ddtree" in launch.unsupported
    assert f"engine.model {tmp_path / 'next'}" in launch.unsupported and "linear_attention" in launch.unsupported
    assert "--mamba-scheduler-strategy extra_buffer" in launch.unsupported
    assert any(w.startswith("unsupported launch: engine.model") for w in plan.warnings)
    assert "<unsupported: engine.model" in format_plan(plan)  # what --dry-run prints
    with pytest.raises(UnsupportedEngine) as info:
        check_plan(plan)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    assert "(ddtree budget 8" in str(info.value) and "refuses ddtree" in str(info.value)
    # a dflash baseline is refused too, even when the measured algorithm is ar
    plan = make_plan(parse_recipe(_hybrid_recipe(tmp_path, 'algorithm = "ar"\nbaseline = ["dflash"]')))
    assert "refuses dflash" in plan.launches[0].unsupported
    # ar alone, and ddtree at budget 0 (which is ar), run
    for sweep in ('algorithm = "ar"', 'algorithm = "ddtree"\nbudget = [0]'):
        plan = make_plan(parse_recipe(_hybrid_recipe(tmp_path, sweep)))
        assert plan.launches[0].unsupported is None and plan.launches[0].argv is not None
        check_plan(plan)


def test_a_grid_past_the_hard_cap_is_refused_even_with_yes_large():
    import pytest

    from ddtree.jobs.plan import HARD_MAX_POINTS, MAX_POINTS, UnsupportedEngine, check_size

    def recipe(budgets: int, concurrencies: int, temperatures: int):
        return parse_recipe(f'name = "x"\n[sweep]\nbudget = {list(range(budgets))}\n'
                            f'concurrency = {list(range(1, concurrencies + 1))}\n'
                            f'temperature = {[t / 10 for t in range(temperatures)]}\n')

    # 2 billion points: counted from the axes' lengths, so this returns at once instead of
    # building the plan in memory
    with pytest.raises(UnsupportedEngine) as info:
        check_size(recipe(1025, 1999, 1000), allow_large=True)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    assert f"2,048,975,000 points (more than {HARD_MAX_POINTS:,}" in str(info.value)
    # between the two caps: --yes-large lets it through
    between = recipe(100, 50, 3)
    assert MAX_POINTS < 100 * 50 * 3 <= HARD_MAX_POINTS
    with pytest.raises(UnsupportedEngine):
        check_size(between)
    check_size(between, allow_large=True)


def test_builtin_extra_args_reach_the_server_and_bad_ones_are_refused_in_one_line():
    import pytest

    from ddtree.jobs.recipe import RecipeError

    extra = 'draft_model = "/m/drafter"\nextra_args = ["--tokenizer-worker-num", "4", "--incremental-streaming-output"]'
    argv = list(make_plan(parse_recipe(BUILTIN.replace('draft_model = "/m/drafter"', extra))).launches[0].argv)
    assert argv[-3:] == ["--tokenizer-worker-num", "4", "--incremental-streaming-output"]
    server = pytest.importorskip("ddtree.engine.reference.server")
    args = server.build_parser().parse_args(argv[3:])  # the server reads it back
    assert args.tokenizer_worker_num == 4 and args.incremental_streaming_output
    for bad, said in ((["--port", "9"], "--port, which the console manages"),
                      (["--max-running-requests=2"], "--max-running-requests, which the console manages"),
                      (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                      (["--tokenizer-worker-num", "0"], "--tokenizer-worker-num")):
        text = BUILTIN.replace('draft_model = "/m/drafter"', f'draft_model = "/m/drafter"\nextra_args = {bad!r}'
                               .replace("'", '"'))
        with pytest.raises(RecipeError) as caught:
            parse_recipe(text)
        assert said in str(caught.value) and "\n" not in str(caught.value) and caught.value.exit_code == 2
