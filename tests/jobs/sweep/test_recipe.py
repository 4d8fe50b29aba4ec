"""Recipe parsing, validation errors (key named, allowed values, exit code 2), TOML round trip."""

import pytest

from ddtree.jobs.recipe import RecipeError, load_recipe, parse_recipe, recipe_to_toml

GOOD = """
name = "k26"
[engine]
kind = "sglang"
python = "/opt/sglang/bin/python"
model = "moonshotai/Kimi-K2.6"
draft_model = "z-lab/Kimi-K2.6-DFlash"
algorithm = "ddtree"
block_size = 8
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
numa_bind = "auto"
extra_args = ["--attention-backend", "fa3"]
env = { NCCL_DEBUG = "WARN" }
[sweep]
budget = [8, 16, 32, 64, 128]
tp = [4, 8]
concurrency = [1, 4, 16]
dataset = "builtin:code"
num_prompts = 64
max_new_tokens = 256
temperature = 0.0
warmup = 4
repeats = 1
baseline = ["ar", "dflash"]
"""


def test_design_example_parses_and_scalars_become_axes():
    r = parse_recipe(GOOD)
    assert r.engine.kind == "sglang" and r.engine.gpus == tuple(range(8))
    assert r.sweep.budget == (8, 16, 32, 64, 128) and r.sweep.dataset == ("builtin:code",)
    assert r.sweep.temperature == (0.0,) and r.engine.env == (("NCCL_DEBUG", "WARN"),)
    assert r.engine.request_api == "generate" and not r.engine.per_request_spec
    assert r.engine.draft_window is None


def test_draft_window_round_trips():
    r = parse_recipe(GOOD.replace('numa_bind = "auto"', 'numa_bind = "auto"\ndraft_window = 2048'))
    assert r.engine.draft_window == 2048
    assert "draft_window = 2048" in recipe_to_toml(r) and parse_recipe(recipe_to_toml(r)) == r


def test_backend_defaults_to_auto_and_round_trips():
    assert parse_recipe('name = "x"').engine.backend == "auto"
    r = parse_recipe('name = "x"\n[engine]\nbackend = "fast"')
    assert r.engine.backend == "fast"
    assert 'backend = "fast"' in recipe_to_toml(r) and parse_recipe(recipe_to_toml(r)) == r
    assert "backend" not in recipe_to_toml(parse_recipe('name = "x"\n[engine]\nbackend = "auto"'))
    sglang = GOOD.replace('numa_bind = "auto"', 'numa_bind = "auto"\nbackend = "auto"')
    assert parse_recipe(sglang).engine.backend == "auto"  # auto is every engine's own choice


def test_toml_round_trip_is_equal():
    r = parse_recipe(GOOD)
    assert parse_recipe(recipe_to_toml(r)) == r
    minimal = parse_recipe('name = "x"')
    assert parse_recipe(recipe_to_toml(minimal)) == minimal
    odd = parse_recipe('name = "quote \\" and \\\\ and é"\n[sweep]\nrequest_rate = 2.5\ntemperature = [0, 0.7]\n')
    assert parse_recipe(recipe_to_toml(odd)) == odd


@pytest.mark.parametrize("text, needle", [
    ('name = "x"\n[engine]\nkidn = "builtin"', "unknown key 'engine.kidn'"),
    ('name = "x"\n[engine]\nblock-size = 8', "did you mean 'block_size'"),
    ('name = "x"\n[sweeps]\nbudget = [1]', "unknown key 'sweeps'"),
    ('name = "x"\n[sweep]\nbudget = []', "sweep.budget is an empty list"),
    ('name = "x"\n[sweep]\nconcurrency = "4"', "sweep.concurrency must be an integer, got a string"),
    ('name = "x"\n[sweep]\nconcurrency = [1, 0]', "sweep.concurrency[1] must be >= 1"),
    ('name = "x"\n[sweep]\nbudget = [8, 8]', "lists a value twice"),
    ('name = "x"\n[engine]\nalgorithm = "ar"\n[sweep]\nbudget = [8]', "budget applies to algorithm ddtree only"),
    ('name = "x"\n[engine]\nkind = "tgi"', "allowed: builtin, sglang, vllm"),
    ('name = "x"\n[engine]\nalgorithm = "eagle"', "allowed: ar, dflash, ddtree"),
    ('name = "x"\n[sweep]\nbaseline = ["ddtree"]', "allowed: ar, dflash"),
    ('name = "x"\n[sweep]\ntp = [2]', "builtin engine runs on one device"),
    ('name = "x"\n[engine]\nkind = "sglang"\nmodel = "m"\ngpus = [0, 1]\n[sweep]\ntp = [4]', "needs 4 GPUs"),
    ('name = "x"\n[engine]\nkind = "sglang"', 'engine.model is required for kind = "sglang"'),
    ('name = "x"\n[engine]\nkind = "vllm"\nmodel = "m"\ndraft_window = 512', "draft_window applies to kind"),
    ('name = "x"\n[engine]\ndraft_window = 512', "draft_window applies to kind"),
    ('name = "x"\n[engine]\nkind = "sglang"\nmodel = "m"\ndraft_window = 0', "engine.draft_window must be >= 1"),
    ('name = "x"\n[engine]\nkind = "sglang"\nmodel = "m"\ndraft_window = "big"', "engine.draft_window must be an"),
    ('name = "x"\n[engine]\nbackend = "bogus"', "engine.backend = 'bogus' is not allowed"),
    ('name = "x"\n[engine]\nbackend = 1', "engine.backend must be a string"),
    ('name = "x"\n[engine]\nkind = "sglang"\nmodel = "m"\nbackend = "fast"', "engine.backend applies to kind"),
    ('name = "x"\n[engine]\nkind = "vllm"\nmodel = "m"\nbackend = "transformers"', "engine.backend applies"),
    ('name = "x"\n[sweep]\ntemperature = -1', "sweep.temperature must be a finite number >= 0"),
    ('name = "x"\n[sweep]\ntimeout_s = inf', "sweep.timeout_s must be a finite number >= 1, got inf"),
    ('name = "x"\n[sweep]\ntimeout_s = nan', "sweep.timeout_s must be a finite number >= 1, got nan"),
    ('name = "x"\n[sweep]\ntimeout_s = 0.5', "sweep.timeout_s must be a finite number >= 1, got 0.5"),
    ('name = "x"\n[sweep]\nstop_e2e_p99_s = inf', "sweep.stop_e2e_p99_s must be a finite number"),
    ('name = "x"\n[engine]\nready_timeout_s = inf', "engine.ready_timeout_s must be a finite number"),
    ('name = "x"\n[engine]\nblock_size = 100000', "engine.block_size must be <= 64, got 100000"),
    ('name = "x"\n[engine]\nblock_size = 1', "engine.block_size must be >= 2"),
    ('name = "x"\n[engine]\ndevice = "tpu"', "engine.device = 'tpu' is not allowed (allowed: cpu, cuda; a sweep"),
    ('name = "x"\n[engine]\ndevice = "cuda:1"', "engine.device = 'cuda:1' is not allowed (allowed: cpu, cuda; a sweep"),
    ('name = "x"\n[sweep]\nnum_prompts = 2.5', "sweep.num_prompts must be an integer"),
    ('name = "x"\n[engine]\ngpus = 0', "engine.gpus must be a list"),
    ('name = "x"\n[engine]\nenv = { A = 1 }', "engine.env.A must be a string"),
    ('[sweep]\nbudget = [1]', "missing key 'name'"),
    ('name = ', "not valid TOML"),
    ('name = "x"\n[sweep]\nnum_prompts = 1' + "0" * 5000, "a number has more digits"),  # past int()'s limit
    ('name = 3', "name must be a string"),
])
def test_bad_recipes_name_the_key_and_exit_2(text, needle):
    with pytest.raises(RecipeError) as info:
        parse_recipe(text)
    assert needle in str(info.value)
    assert info.value.exit_code == 2


def test_missing_file_is_bad_input(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "nope.toml")
    assert info.value.exit_code == 2 and "not found" in str(info.value)


def test_shipped_demo_recipe_is_valid():
    from pathlib import Path

    r = load_recipe(Path(__file__).resolve().parents[3] / "assets" / "recipes" / "demo.toml")
    assert r.engine.kind == "builtin" and len(r.sweep.budget) >= 2


@pytest.mark.parametrize("line, says", [
    ("num_prompts = -3", "sweep.num_prompts must be >= 1, got -3"),
    ("num_prompts = 0", "sweep.num_prompts must be >= 1, got 0"),
    ("max_new_tokens = 99999999999999999999999", "sweep.max_new_tokens must be <= 1048576"),
    ("max_new_tokens = 2000000", "sweep.max_new_tokens must be <= 1048576"),
    ("repeats = -1", "sweep.repeats must be >= 1")])
def test_a_count_out_of_bounds_gets_one_message_whatever_its_size(line, says):
    with pytest.raises(RecipeError) as info:
        parse_recipe(f'name = "x"\n[sweep]\n{line}\n')
    assert says in str(info.value)
