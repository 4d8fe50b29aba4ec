"""Fixtures for the engine-side tests (fake interpreters: see engine_fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from .engine_fakes import make_fake_python, recorded_help


@pytest.fixture
def fake_python(tmp_path):
    count = [0]

    def make(kind: str = "sglang", help_text: str | None = None, version: str = "0.5.23",
             server_body: str | None = None) -> Path:
        count[0] += 1
        text = help_text if help_text is not None else recorded_help("0.5.23")
        return make_fake_python(tmp_path / f"py{count[0]}", kind, text, version, server_body)

    return make


@pytest.fixture(autouse=True)
def _fresh_probe_memo():
    from ddtree.engine.serving import probe

    probe._MEMO.clear()
    yield
    probe._MEMO.clear()
