"""A model is shown by the name a user gave or by its repo id, never by an install path."""

from __future__ import annotations

import pytest

from ddtree.engine.serving.names import display_name, run_drafter_name, run_model_name


def test_the_demo_pair_reads_as_demo_target_and_demo_drafter():
    import ddtree.assets
    from pathlib import Path

    root = Path(ddtree.assets.__file__).parent / "demo"
    assert display_name(str(root / "target")) == "demo/target"
    assert display_name(str(root / "drafter")) == "demo/drafter"
    assert display_name(str((root / "target").resolve())) == "demo/target"
    assert display_name("demo") == "demo/target"  # what the engines table records for the demo


def test_the_demo_pair_as_the_engine_finds_it():
    from ddtree.engine.demo import DemoMissing, demo_paths

    try:
        target, drafter = demo_paths()
    except DemoMissing:
        pytest.skip("the demo pair is not installed here")
    assert (display_name(str(target)), display_name(str(drafter))) == ("demo/target", "demo/drafter")
    assert "__editable__" not in display_name(str(target))


@pytest.mark.parametrize("given, shown", [
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
    ("z-lab/Qwen3-8B-DFlash-b16", "z-lab/Qwen3-8B-DFlash-b16"),
    ("/data/hf/hub/models--moonshotai--Kimi-K2.6/snapshots/0123abcd", "moonshotai/Kimi-K2.6"),
    ("/data/hf/hub/models--Qwen--Qwen3-8B", "Qwen/Qwen3-8B"),
    ("/models/my-finetune", "/models/my-finetune"),
    (None, "-"),
    ("  ", "-"),
])
def test_hub_ids_cache_folders_and_user_paths(given, shown):
    assert display_name(given) == shown


def test_a_run_names_its_pair_one_way_everywhere():
    """runs, History, the compare view and the md export all call these: a run recorded without
    a model ran the demo pair (it read '-', 'demo/target' and 'demo' in three views)."""
    assert run_model_name(None) == run_model_name("demo") == "demo/target"
    assert run_drafter_name(None, None) == "demo/drafter"
    assert run_drafter_name(None, "Qwen/Qwen3-8B") == "-"
    assert (run_model_name("Qwen/Qwen3-8B"), run_drafter_name("z-lab/Qwen3-8B-DFlash-b16", "Qwen/Qwen3-8B")) == (
        "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
