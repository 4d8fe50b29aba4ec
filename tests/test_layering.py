"""The headless core stays headless: importing any module of ddtree.store, ddtree.jobs or
ddtree.engine (except engine.reference) loads neither textual nor torch, and no console module
loads torch. Modules are found by walking the packages, so new ones are covered."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    headless = ["ddtree.store", "ddtree.jobs", "ddtree.engine"]
    found, offenders = [], {}
    def walk(package):
        mod = importlib.import_module(package)
        names = [package]
        for info in pkgutil.walk_packages(mod.__path__, package + "."):
            if not info.name.startswith("ddtree.engine.reference"):
                names.append(info.name)
        return names
    def check(name, banned):
        importlib.import_module(name)
        bad = sorted(b for b in banned if b in sys.modules)
        if bad:
            offenders[name] = bad
        found.append(name)
    for package in headless:
        for name in walk(package):
            if name not in found and not offenders:
                check(name, ("textual", "torch", "transformers"))
    for name in walk("ddtree.console"):
        if name not in found and not offenders:
            check(name, ("torch", "transformers"))
    print(json.dumps({"modules": found, "offenders": offenders}))
    """
)


def test_headless_modules_import_neither_textual_nor_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["offenders"] == {}, f"the first module to pull a banned package: {doc['offenders']}"
    modules = set(doc["modules"])
    for expected in ("ddtree.store.db", "ddtree.jobs.supervisor", "ddtree.jobs.kinds.sleep", "ddtree.console.cli"):
        assert expected in modules
    assert not any(m.startswith("ddtree.engine.reference") for m in modules)


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("import-linter is not installed")
    out = subprocess.run([exe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
