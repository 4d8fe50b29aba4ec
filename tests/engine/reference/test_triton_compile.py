"""The Triton kernels compile for a Hopper GPU (sm_90), here, without one.

The interpreter tests (test_tree_attention.py, test_tree_kernel.py) run the kernels as Python, so
they never meet Triton's front end and code generator: a global that is not constexpr, or a loop
variable that changes type, passes them and fails only on a GPU. This compiles every kernel to a
cubin, as a CUDA launch would, in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.engine.reference.fast import tree_attention

SCRIPT = Path(__file__).resolve().parents[2] / "support" / "triton_compile.py"


def _has_cuda_backend() -> bool:
    if not tree_attention.available():
        return False
    import importlib.util

    return importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not _has_cuda_backend(), reason="needs triton with its CUDA backend")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("ok ") == 40, done.stdout  # 9 of them the few-row kernels (fast/gemv.py)
