"""`pip install .` and `pip install -e .` into a fresh venv give a working `ddtree-console --version`.

No dependencies are installed (--no-deps), so this also proves `--version` imports nothing
beyond the standard library. The build backend (setuptools) is lent from the running
interpreter's environment (links, removed after the build), so the test needs no network.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _project_copy(dst: Path) -> Path:
    """Copy what the distribution is built from (not build/, egg-info, caches)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(config["tool"]["setuptools"]["package-dir"].values())
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dst.mkdir()
    for name in ["pyproject.toml", "README.md", "LICENSE"]:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    for folder in folders:
        shutil.copytree(ROOT / folder, dst / folder, ignore=ignore, symlinks=True)
    return dst


_BACKEND = ("setuptools", "_distutils_hack", "pkg_resources", "distutils-precedence.pth")


def _lend_backend(site: Path) -> list[Path]:
    """Link this interpreter's setuptools into the fresh venv for the build; returns the links."""
    ours = Path(sysconfig.get_paths()["purelib"])
    links = []
    # setuptools registers its commands through the entry points of its dist-info.
    for name in [*_BACKEND, *(p.name for p in ours.glob("setuptools-*.dist-info"))]:
        if (ours / name).exists() and not (site / name).exists():
            (site / name).symlink_to(ours / name)
            links.append(site / name)
    return links


def _run(argv, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=150, **kw)
    assert out.returncode == 0, f"{argv}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_fresh_venv_install_runs_version(tmp_path, editable):
    src = _project_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    # Without pip inside: the running pip installs into it with --python (much faster than ensurepip).
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip())
    links = _lend_backend(site)
    target = ["-e", str(src)] if editable else [str(src)]
    build_env = dict(env, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    try:
        _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-build-isolation", *target],
             env=build_env, cwd=tmp_path)
    finally:
        for link in links:
            link.unlink()
    out = _run([str(venv / "bin" / "ddtree-console"), "--version"], env=env, cwd=tmp_path)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.stdout.strip() == f"ddtree-console {version}"
    # the package really is the installed one, in its namespace
    where = _run([str(py), "-c", "import ddtree.console.cli as m; print(m.__file__)"], env=env, cwd=tmp_path)
    assert str(src if editable else venv) in where.stdout
    # nothing generic landed in site-packages
    assert not any((site / name).exists() for name in ("store", "jobs", "engine", "console"))
