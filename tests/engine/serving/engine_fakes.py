"""Fake engine interpreters: a real python with a tiny `sglang` (or `vllm`) package on its path.

`fake_python(tmp_path, kind, help_text, version)` writes a shell wrapper that runs this
interpreter with PYTHONPATH pointing at a package whose `launch_server --help` prints a recorded
help text and whose `launch_server` otherwise runs `server_body` (a small HTTP server)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"


def recorded_help(version: str) -> str:
    return (DATA / f"sglang-{version}-help.txt").read_text()


def ddtree_help() -> str:
    """SGLang 0.5.23's recorded help as PR #29907 changes it: DDTREE among the builtins and
    --speculative-ddtree-budget beside the other speculative flags."""
    text = recorded_help("0.5.23")
    text = text.replace("NGRAM, DFLASH, DSPARK, UNO.", "NGRAM, DFLASH, DSPARK, UNO, DDTREE.")
    text = text.replace(
        "                    [--speculative-dflash-block-size SPECULATIVE_DFLASH_BLOCK_SIZE]\n",
        "                    [--speculative-dflash-block-size SPECULATIVE_DFLASH_BLOCK_SIZE]\n"
        "                    [--speculative-ddtree-budget SPECULATIVE_DDTREE_BUDGET]\n", 1)
    text = text.replace(
        "  --speculative-dspark-block-size SPECULATIVE_DSPARK_BLOCK_SIZE\n",
        "  --speculative-ddtree-budget SPECULATIVE_DDTREE_BUDGET\n"
        "                        DDTREE only. Number of draft-tree nodes verified per\n"
        "                        round (the tree verify window is budget + 1).\n"
        "  --speculative-dspark-block-size SPECULATIVE_DSPARK_BLOCK_SIZE\n", 1)
    assert "--speculative-ddtree-budget SPECULATIVE_DDTREE_BUDGET\n  " in text
    return text


LAUNCH_SERVER = '''
import os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
if "--help" in sys.argv[1:] or "--help=all" in sys.argv[1:]:
    with open(os.path.join(HERE, "help.txt")) as fh:
        sys.stdout.write(fh.read())
    raise SystemExit(0)
body = os.path.join(HERE, "server_body.py")
if not os.path.exists(body):
    print("error: this fake engine only prints help", file=sys.stderr)
    raise SystemExit(2)
sys.argv = [body] + sys.argv[1:]
exec(compile(open(body).read(), body, "exec"), {"__name__": "__main__"})
'''


def make_fake_python(root: Path, kind: str, help_text: str, version: str, server_body: str | None = None) -> Path:
    site = root / "site"
    if kind == "sglang":
        pkg = site / "sglang"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
        (pkg / "launch_server.py").write_text(LAUNCH_SERVER)
    else:
        pkg = site / "vllm" / "entrypoints" / "cli"
        pkg.mkdir(parents=True)
        for p in (site / "vllm", site / "vllm" / "entrypoints", pkg):
            (p / "__init__.py").write_text(f"__version__ = {version!r}\n" if p == site / "vllm" else "")
        (pkg / "main.py").write_text(LAUNCH_SERVER)
        cfg = site / "vllm" / "config"
        cfg.mkdir()
        (cfg / "__init__.py").write_text("")
        (cfg / "speculative.py").write_text(
            'from typing import Literal\nDFlashModelTypes = Literal["dflash"]\n'
            'EagleModelTypes = Literal["eagle", "eagle3", DFlashModelTypes]\n'
            'SpeculativeMethod = Literal["ngram", "medusa", "draft_model", EagleModelTypes]\n')
    (pkg / "help.txt").write_text(help_text)
    if server_body is not None:
        (pkg / "server_body.py").write_text(server_body)
    wrapper = root / "bin" / "python"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper
