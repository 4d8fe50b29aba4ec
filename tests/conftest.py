"""Fixtures more than one test folder uses: the tiny random pair on disk (built once a session)
and a real builtin server on it (one a module). The builders live in tests/support/."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from .support.server import CLI, ServerProcess


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton's interpreter runs the tree-attention kernels on CPU tensors
# (fast/tree_attention.py), so the tests check that code here too. Triton reads the switch when it
# is first imported, so it is set before any test runs.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    from .support.pair import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    """One server per module, started the way a user starts it: `ddtree-console serve` (which execs
    the server module). The drafter was trained with blocks of 4; the server runs it with 3."""
    target, drafter = tiny_pair
    proc = ServerProcess([*CLI, "serve", "--model", str(target), "--draft", str(drafter), "--port", "0",
                          "--budget", "8", "--block-size", "3", "--max-running-requests", "4",
                          "--max-queued-requests", "4"], tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log_tail()
