"""Every example in assets/recipes/ parses and plans with `sweep --dry-run`: the builtin ones as
they are, the SGLang ones with their interpreter swapped for a fake SGLang (recorded --help of a
release, or of a DDTree-capable build), so the exact launch command is checked too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..engine.serving.engine_fakes import ddtree_help, make_fake_python, recorded_help

from ddtree.jobs.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "assets" / "recipes"
SCHEMA = RECIPES / "SCHEMA.md"

pytestmark = pytest.mark.timeout(300)


def dry_run(tmp_path, recipe: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), "sweep",
                          str(recipe), "--dry-run", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "d.db").exists()  # a dry run writes nothing
    return json.loads(out.stdout)


def with_python(tmp_path, recipe: Path, python: Path) -> Path:
    text = re.sub(r'^python = "[^"]*"', f'python = "{python}"', recipe.read_text(), count=1, flags=re.M)
    path = tmp_path / recipe.name
    path.write_text(text)
    return path


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_examples_are_all_there_and_documented():
    names = {p.name for p in RECIPES.glob("*.toml")}
    assert {"demo.toml", "builtin-gpu.toml", "qwen3-8b-dflash-sglang.toml", "kimi-k2.6-dflash-sglang-tp8.toml",
            "qwen3-8b-ddtree-sglang.toml"} <= names
    for path in RECIPES.glob("*.toml"):
        assert path.read_text().startswith("#"), f"{path.name} opens with a comment saying what it measures"
        load_recipe(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["demo.toml", "builtin-gpu.toml"])
def test_builtin_examples_dry_run(name, tmp_path):
    plan = dry_run(tmp_path, RECIPES / name)
    (launch,) = plan["launches"]
    assert launch["unsupported"] is None and "ddtree.engine.reference.server" in " ".join(launch["argv"])
    if name == "builtin-gpu.toml":
        assert flag(launch["argv"], "--device") == "cuda" and flag(launch["argv"], "--model") == "Qwen/Qwen3-8B"


@pytest.mark.slow
def test_qwen3_dflash_on_sglang_at_tp_1_and_2(tmp_path):
    python = make_fake_python(tmp_path / "sg", "sglang", recorded_help("0.5.23"), "0.5.23")
    plan = dry_run(tmp_path, with_python(tmp_path, RECIPES / "qwen3-8b-dflash-sglang.toml", python))
    launches = [l for l in plan["launches"] if l["algorithm"] == "dflash"]
    assert sorted(l["tp"] for l in launches) == [1, 2]
    for launch in launches:
        assert launch["unsupported"] is None
        argv = launch["argv"]
        assert flag(argv, "--speculative-algorithm") == "DFLASH"
        assert flag(argv, "--speculative-draft-model-path") == "z-lab/Qwen3-8B-DFlash-b16"
        assert flag(argv, "--tp-size") == str(launch["tp"])


def test_kimi_on_sglang_tp8_block_8(tmp_path):
    python = make_fake_python(tmp_path / "sg", "sglang", recorded_help("0.5.23"), "0.5.23")
    plan = dry_run(tmp_path, with_python(tmp_path, RECIPES / "kimi-k2.6-dflash-sglang-tp8.toml", python))
    (launch,) = [l for l in plan["launches"] if l["algorithm"] == "dflash"]
    argv = launch["argv"]
    assert launch["unsupported"] is None and flag(argv, "--tp-size") == "8"
    assert flag(argv, "--model-path") == "moonshotai/Kimi-K2.6"
    assert "8" in (argv[argv.index(f) + 1] for f in ("--speculative-dflash-block-size",
                                                      "--speculative-num-draft-tokens") if f in argv)


@pytest.mark.slow
def test_ddtree_on_a_ddtree_capable_sglang_and_refused_on_a_release(tmp_path):
    recipe = RECIPES / "qwen3-8b-ddtree-sglang.toml"
    build = make_fake_python(tmp_path / "dd", "sglang", ddtree_help(), "0.5.23.dev29907")
    plan = dry_run(tmp_path, with_python(tmp_path, recipe, build))
    ddtree = [l for l in plan["launches"] if l["algorithm"] == "ddtree"]
    assert sorted(l["budget"] for l in ddtree) == [8, 16, 32, 64, 128]
    for launch in ddtree:
        assert launch["unsupported"] is None
        assert flag(launch["argv"], "--speculative-algorithm") == "DDTREE"
        assert flag(launch["argv"], "--speculative-ddtree-budget") == str(launch["budget"])
    release = make_fake_python(tmp_path / "rel", "sglang", recorded_help("0.5.23"), "0.5.23")
    plan = dry_run(tmp_path, with_python(tmp_path, recipe, release))
    assert all("DDTREE" in (l["unsupported"] or "") for l in plan["launches"] if l["algorithm"] == "ddtree")


def test_the_schema_names_every_key_of_every_table():
    from ddtree.jobs.recipe import EngineSpec, SweepSpec

    text = SCHEMA.read_text()
    for table, spec in (("engine", EngineSpec), ("sweep", SweepSpec)):
        for key in spec.__dataclass_fields__:
            assert f"`{table}.{key}`" in text, f"{table}.{key} is not in SCHEMA.md"
