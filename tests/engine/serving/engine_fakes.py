"""Fake engine interpreters: a real python with a tiny `sglang` (or `vllm`) package on its path.

`fake_python(tmp_path, kind, help_text, version)` writes a shell wrapper that runs this
interpreter with PYTHONPATH pointing at a package whose `launch_server --help` prints a recorded
help text and whose `launch_server` otherwise runs `server_body` (a small HTTP server: STANDIN, a
stand-in SGLang, or DIES, a launch that runs out of memory)."""

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


# -- server bodies for fake_python(server_body=...) -----------------------------------------

# SGLang's surface as far as the runner and the bench client use it. Flags are parsed strictly
# (an unknown one exits 2 with argparse's "unrecognized arguments", as SGLang does). Counters start
# as if the server had served other runs since boot at tau 1.0, so only differences give a
# point's tau. The warm-up prompt (STANDIN_WARM) is accepted at tau 2, every other at tau 4.
STANDIN = r'''
import argparse, json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
fail_once = os.environ.get("STANDIN_FAIL_ONCE")
if fail_once and not os.path.exists(fail_once):
    open(fail_once, "w").close()
    print("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address already in use",
          file=sys.stderr, flush=True)
    sys.exit(1)
p = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--speculative-draft-model-path"):
    p.add_argument(flag)
for flag in ("--tp-size", "--port", "--speculative-num-draft-tokens", "--speculative-ddtree-budget", "--page-size",
             "--speculative-draft-window-size"):
    p.add_argument(flag, type=int)
p.add_argument("--speculative-algorithm", choices=["DFLASH", "DDTREE"])
p.add_argument("--enable-metrics", action="store_true")
args = p.parse_args()
print("server_args=" + json.dumps(vars(args)), flush=True)
print("cuda_visible_devices=" + os.environ.get("CUDA_VISIBLE_DEVICES", "-"), flush=True)
spec = args.speculative_algorithm is not None
state = {"tokens": 1000, "verify": 1000 if spec else 0, "requests": 50, "affinity": False}
ready_at = time.time() + 0.3
lock = threading.Lock()
warm = os.environ.get("STANDIN_WARM")


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send(self, code, body, ctype="application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self.send(200 if time.time() > ready_at else 503, "{}")
        if self.path == "/metrics" and args.enable_metrics:
            with lock:
                return self.send(200, (
                    "# TYPE sglang:generation_tokens_total counter\n"
                    f'sglang:generation_tokens_total{{model_name="m"}} {state["tokens"]}.0\n'
                    "# TYPE sglang:spec_verify_calls_total counter\n"
                    f'sglang:spec_verify_calls_total{{model_name="m"}} {state["verify"]}.0\n'
                    "# TYPE sglang:num_requests_total counter\n"
                    f'sglang:num_requests_total{{model_name="m"}} {state["requests"]}.0\n'), "text/plain")
        if self.path in ("/server_info", "/get_server_info"):
            with lock:  # cumulative since boot: what a per-run figure must never be read from
                tau = state["tokens"] / state["verify"] if state["verify"] else None
            return self.send(200, json.dumps({"internal_states": [{"avg_spec_accept_length": tau}]}))
        self.send(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/generate":
            return self.send(404, "{}")
        with lock:
            if not state["affinity"] and hasattr(os, "sched_getaffinity"):
                state["affinity"] = True
                print("affinity=" + json.dumps(sorted(os.sched_getaffinity(0))), flush=True)
        n = body["sampling_params"]["max_new_tokens"]
        meta = {"id": "r", "prompt_tokens": 5, "completion_tokens": n, "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": n}, "e2e_latency": 0.01}
        verify = 0
        if spec:
            tau = 2 if body.get("text") == warm else 4
            verify = -(-n // tau)
            meta.update(spec_verify_ct=verify, spec_accept_length=n / verify, spec_num_correct_drafts=n - verify,
                        spec_correct_drafts_histogram=[0] * (tau - 1) + [verify])
        with lock:
            state["tokens"] += n
            state["verify"] += verify
            state["requests"] += 1
        self.send(200, json.dumps({"text": "x" * n, "output_ids": [7] * n, "meta_info": meta}))


ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''

DIES = r'''
import sys
print("[2026-11-20 10:02:11 TP0] Load weight begin. avail mem=78.50 GB", flush=True)
print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
      "of 79.19 GiB of which 1.06 GiB is free.", file=sys.stderr, flush=True)
sys.exit(1)
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
