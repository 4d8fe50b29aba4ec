"""Log classification on realistic failure tails of SGLang, vLLM and uvicorn."""

from __future__ import annotations

import pytest

from ddtree.engine.serving.logclass import classify, classify_tail, failure_reason

OOM = """[2026-11-20 10:02:11 TP0] Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=3.12 GB, mem usage=137.55 GB.
[2026-11-20 10:02:12 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/opt/sglang/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 3350, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.06 GiB is free.
[2026-11-20 10:02:12 TP3] NCCL WARN Cuda failure 'out of memory'
[2026-11-20 10:02:13] Received sigquit from a child process. It usually means the child failed.
"""
NCCL = """[2026-11-20 11:00:01 TP1] Init torch distributed begin.
[rank1]: Traceback (most recent call last):
[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3
[rank1]: ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
"""
PORT = """INFO:     Started server process [41237]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use
INFO:     Waiting for application shutdown.
"""
MISSING = """[2026-11-20 12:00:00] server_args=ServerArgs(model_path='/models/Qwen3-8B', ...)
Traceback (most recent call last):
OSError: /models/Qwen3-8B does not appear to have a file named config.json. Checkout 'https://huggingface.co//models/Qwen3-8B/tree/None' for available files.
"""
WEIGHTS = "RuntimeError: Cannot find any model weights with `/models/empty`\n"
FLAG = """usage: sglang serve [-h] --model-path MODEL_PATH
sglang serve: error: unrecognized arguments: --speculative-ddtree-budget 64
"""
CHOICE = "sglang serve: error: argument --speculative-algorithm: invalid choice: 'DDTREE' (choose from 'DFLASH', 'EAGLE')\n"
IMPORT = """Traceback (most recent call last):
  File "<frozen runpy>", line 189, in _run_module_as_main
ModuleNotFoundError: No module named 'sgl_kernel'
"""
NOMOD = "/usr/bin/python3: Error while finding module specification for 'sglang.launch_server' (ModuleNotFoundError: No module named 'sglang')\n"
HEALTHY_WARNINGS = """[2026-11-20 10:00:00] WARNING: Failed to import flash_attn; ImportError: flash_attn not installed, falling back
[2026-11-20 10:00:05] Not enough memory. Please try to increase --mem-fraction-static.
"""
VLLM_KV = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.\n"


@pytest.mark.parametrize("text,code", [
    (OOM, "cuda_oom"), (NCCL, "nccl"), (PORT, "port_in_use"), (MISSING, "missing_model"),
    (WEIGHTS, "missing_model"), (FLAG, "unsupported_flag"), (CHOICE, "unsupported_flag"),
    (IMPORT, "import_error"), (NOMOD, "import_error"), (HEALTHY_WARNINGS, "cuda_oom"), (VLLM_KV, "cuda_oom"),
])
def test_classify(text, code):
    verdict = classify(text)
    assert verdict is not None and verdict.code == code, verdict


def test_root_cause_wins_over_consequences():
    # The OOM log also carries an NCCL warning from a peer rank: the OOM is the cause.
    verdict = classify(OOM)
    assert verdict.reason == "CUDA out of memory" and "Tried to allocate" in verdict.line


def test_nothing_known():
    assert classify("INFO: all good\n") is None and classify("") is None


def test_tail_of_a_file(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("x" * 500_000 + "\n" + PORT)
    assert classify_tail(log, max_bytes=4096).code == "port_in_use"
    assert failure_reason(log, "exit code 1").startswith("port in use: ERROR:")
    assert failure_reason(tmp_path / "missing.log", "exit code 1") == "exit code 1"
