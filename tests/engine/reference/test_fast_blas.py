"""fast/blas.py: the fast backend asks cuBLAS for a small workspace, and a user's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddtree.engine.reference.fast import blas


@pytest.fixture
def no_setting(monkeypatch):
    # setenv first: a delenv of an unset name records nothing to undo, and what the ask then
    # sets would outlive the test
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(blas, "wanted", True)


def test_asks_for_the_small_workspace_when_none_is_set(no_setting):
    assert blas.ask_small_workspace() == blas.SMALL_WORKSPACE
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == blas.SMALL_WORKSPACE


def test_a_users_setting_wins(no_setting, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert blas.ask_small_workspace() == ":4096:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_turned_off_it_leaves_torchs_default(no_setting, monkeypatch):
    monkeypatch.setattr(blas, "wanted", False)
    assert blas.ask_small_workspace() is None
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_a_cpu_engine_does_not_ask(no_setting, tiny_target):
    from ddtree.engine.reference.engine import Engine

    engine = Engine(tiny_target, None, backend="fast")
    assert engine.cublas_workspace is None
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_asks_and_its_greedy_output_is_ar_s():
    """In a process of its own, so that cuBLAS's first use comes after the ask."""
    code = """
import os, torch
from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from tests.support.pair import make_drafter, make_target
target = make_target(0).to("cuda")
engine = Engine(target, make_drafter(target).to("cuda"), backend="fast", max_budget=16)
assert engine.cublas_workspace == os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":1:1", engine.cublas_workspace
prompt = list(range(5, 30))
out = {a: engine.generate(prompt, GenParams(max_new_tokens=24), SpecParams(a, 16)).output_ids for a in ("ar", "dflash", "ddtree")}
assert out["dflash"] == out["ar"] == out["ddtree"], out
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
