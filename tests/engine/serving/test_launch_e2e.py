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

# A minimal server with SGLang's surface: parses the flags we pass, counts like SGLang does.
SERVER = r'''
import argparse, json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
p = argparse.ArgumentParser()
p.add_argument("--model-path"); p.add_argument("--tp-size", type=int); p.add_argument("--host")
p.add_argument("--port", type=int); p.add_argument("--enable-metrics", action="store_true")
p.add_argument("--speculative-algorithm"); p.add_argument("--speculative-draft-model-path")
p.add_argument("--speculative-num-draft-tokens", type=int)
args = p.parse_args()
state = {"tokens": 0, "verify": 0, "requests": 0, "ready_at": time.time() + 0.5}
lock = threading.Lock()
print("server_args=" + json.dumps(vars(args)), flush=True)

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def send(self, code, body, ctype="application/json"):
        data = body.encode(); self.send_response(code); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            return self.send(200 if time.time() > state["ready_at"] else 503, "{}")
        if self.path == "/metrics" and args.enable_metrics:
            with lock:
                return self.send(200, (
                    "# TYPE sglang:generation_tokens_total counter\n"
                    f'sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} {state["tokens"]}.0\n'
                    "# TYPE sglang:spec_verify_calls_total counter\n"
                    f'sglang:spec_verify_calls_total{{model_name="m"}} {state["verify"]}.0\n'
                    f'sglang:num_requests_total{{is_streaming="false",model_name="m"}} {state["requests"]}.0\n'),
                    "text/plain; version=0.0.4")
        self.send(404, "{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        block = args.speculative_num_draft_tokens or 1
        verify = -(-n // min(block, 4))  # this stand-in accepts 4 tokens per round
        with lock:
            state["tokens"] += n; state["verify"] += verify; state["requests"] += 1
        self.send(200, json.dumps({"text": "x" * n, "meta_info": {
            "prompt_tokens": 5, "completion_tokens": n, "spec_verify_ct": verify,
            "spec_accept_length": n / verify}}))

ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''

DIES = r'''
import sys
print("[2026-11-20 10:02:11 TP0] Load weight begin.", flush=True)
print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
      "of 79.19 GiB of which 1.06 GiB is free.", file=sys.stderr, flush=True)
sys.exit(1)
'''


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
    python = fake_python("sglang", server_body=SERVER)
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
