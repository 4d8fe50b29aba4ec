"""Where the shipped demo pair lives (no torch here: the console and jobs call this too)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ddtree.engine.errors import EngineError


class DemoMissing(EngineError):
    exit_code = 1


def demo_paths() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the demo pair shipped in ddtree.assets/demo."""
    root = Path(str(resources.files("ddtree.assets"))) / "demo"
    target, drafter = root / "target", root / "drafter"
    missing = [p for p in (target, drafter) if not (p / "config.json").is_file()]
    if missing:
        raise DemoMissing(
            "the demo model pair is not installed (" + ", ".join(str(p) for p in missing) + " lacks config.json)",
            "train it with `python -m ddtree.engine.reference.train_demo`, or pass --model/--draft",
        )
    return target, drafter
