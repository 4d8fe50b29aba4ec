"""The name a model is shown by: the one a user gave, or its hub repo id, never an install path.

The demo pair lives inside the installed package (with an editable install, under
`build/__editable__.../ddtree/assets/demo/`), a path that means nothing to a user; it is shown as
`demo/target` and `demo/drafter`. A folder in the Hugging Face cache
(`.../models--Qwen--Qwen3-8B/snapshots/<rev>`) is shown as its repo id. Anything else is shown as
given. No torch and no file reads beyond resolving paths: the console calls this per table row.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

DEMO_NAMES = {"target": "demo/target", "drafter": "demo/drafter"}


@lru_cache(maxsize=1)
def _demo_dirs() -> dict[str, str]:
    """Resolved demo folder -> its shown name, for each way the package can be found."""
    import ddtree.assets

    roots = {Path(ddtree.assets.__file__).parent / "demo"}
    try:
        from importlib import resources

        roots.add(Path(str(resources.files("ddtree.assets"))) / "demo")
    except (ImportError, TypeError):  # a zipped or odd install: the __file__ root still counts
        pass
    out: dict[str, str] = {}
    for root in roots:
        for part, name in DEMO_NAMES.items():
            folder = root / part
            out[str(folder)] = name
            out[str(folder.resolve())] = name
    return out


def _hub_cache_id(parts: tuple[str, ...]) -> str | None:
    for i, part in enumerate(parts):
        # models--org--name[/snapshots/<rev>]: the cache's folder for repo org/name
        if part.startswith("models--") and (i == len(parts) - 1 or parts[i + 1] == "snapshots"):
            repo = part.removeprefix("models--").split("--")
            if all(repo):
                return "/".join(repo)
    return None


def display_name(path: str | None) -> str:
    """How to show the model at `path` (a folder or a hub id); '-' for none.

    >>> display_name("Qwen/Qwen3-8B")
    'Qwen/Qwen3-8B'
    >>> display_name("/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/abc123")
    'Qwen/Qwen3-8B'
    """
    if path is None or not str(path).strip():
        return "-"
    text = str(path).strip()
    if text in ("demo", "demo/target"):  # the engines table records the demo pair as "demo"
        return "demo/target"
    if text == "demo/drafter":
        return text
    if not text.startswith(("/", ".", "~")):
        return text  # a hub repo id (or a bare name the user typed): shown as typed
    p = Path(text).expanduser()
    demo = _demo_dirs()
    shown = demo.get(str(p)) or demo.get(str(p.absolute()))
    if shown is None:
        try:
            shown = demo.get(str(p.resolve()))
        except OSError:
            shown = None
    if shown is not None:
        return shown
    return _hub_cache_id(p.parts) or text


def run_model_name(model: str | None) -> str:
    """A run's target as every view names it: a run recorded without one ran the demo pair."""
    return display_name(model or "demo")


def names_demo_pair(text: str) -> bool:
    """Whether a search for `text` should find runs of the demo pair: it is part of the names
    they are shown by (run_model_name and run_drafter_name of a run recorded without a model)."""
    needle = text.strip().lower()
    return bool(needle) and any(needle in name for name in DEMO_NAMES.values())


def run_drafter_name(draft: str | None, model: str | None) -> str:
    """A run's drafter as every view names it: the demo pair's with the demo target, else '-'."""
    if draft:
        return display_name(draft)
    return "demo/drafter" if not model else "-"
