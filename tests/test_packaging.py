"""Every folder that is a package ships: pyproject's explicit package list misses none of them."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {"console": "ddtree.console", "engine": "ddtree.engine", "jobs": "ddtree.jobs",
       "store": "ddtree.store", "assets": "ddtree.assets"}


def test_every_package_folder_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
