"""End to end with a stand-in SGLang interpreter: probe it, build the launch, spawn it in its own
process group, wait for /health, measure acceptance from two /metrics scrapes and per-request
meta_info over real HTTP on loopback, stop it; and a launch that dies, classified from its log."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest

from ddtree.engine.serving.bench import EngineNotReady, wait_ready
from ddtree.engine.serving.launch import build_launch, free_port
from ddtree.engine.serving.logclass import failure_reason
from ddtree.engine.serving.metrics import fetch_scrape, request_acceptance, run_acceptance, summarize_requests

from .engine_fakes import DIES, STANDIN

def spawn(spec, log_path):
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(list(spec.argv), env=spec.spawn_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


def test_launch_ready_measure_teardown(fake_python, tmp_path):
    python = fake_python("sglang", server_body=STANDIN)
    table = {"kind": "sglang", "python": str(python), "model": "/models/demo", "draft_model": "/models/demo-dflash",
             "block_size": 8, "env": {"DDTREE_TEST": "1"}}
    spec = build_launch(table, algorithm="dflash", budget=None, tp=1, gpus=[], port=free_port(), cache_dir=tmp_path)
    proc = spawn(spec, tmp_path / "engine.log")
    try:
        waited = wait_ready(spec.base_url, timeout_s=30, alive=lambda: None if proc.poll() is None else "exited")
        assert waited >= 0
        with httpx.Client(base_url=spec.base_url, trust_env=False, timeout=10) as client:
            client.post("/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 3}})  # tau 1.0
            before = fetch_scrape(spec.base_url, client=client)
            metas = [client.post("/generate", json={"text": "p", "sampling_params": {"max_new_tokens": 64}}
                                 ).json()["meta_info"] for _ in range(3)]
            after = fetch_scrape(spec.base_url, client=client)
        run = run_acceptance("sglang", before, after)
        assert run.tau == pytest.approx(4.0) and run.requests == 3
        summary = summarize_requests([request_acceptance(m) for m in metas])
        assert summary.tau_weighted == pytest.approx(4.0)
    finally:
        stop(proc)
    assert proc.returncode is not None  # reaped
    assert '"speculative_algorithm": "DFLASH"' in (tmp_path / "engine.log").read_text()


def test_launch_that_dies_is_classified(fake_python, tmp_path):
    python = fake_python("sglang", server_body=DIES)
    spec = build_launch({"kind": "sglang", "python": str(python), "model": "/models/demo"}, algorithm="ar",
                        budget=None, tp=1, gpus=[0], port=free_port(), cache_dir=tmp_path)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0"
    log = tmp_path / "engine.log"
    proc = spawn(spec, log)
    try:
        with pytest.raises(EngineNotReady):
            wait_ready(spec.base_url, timeout_s=30,
                       alive=lambda: None if proc.poll() is None else f"exit code {proc.returncode}")
    finally:
        stop(proc)
    assert failure_reason(log, "exit code 1").startswith("CUDA out of memory: torch.OutOfMemoryError")
