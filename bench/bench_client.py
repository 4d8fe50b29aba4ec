"""Is the sweep client ever the bottleneck? Requests/s and client CPU per request against a trivial
local streaming server (no model: 16 SSE chunks per request in SGLang's /generate shape), measured
side by side in one run with SGLang's own `python -m sglang.benchmark.serving` (the tool that
`sglang.bench_serving` now forwards to), run unmodified as a subprocess of an interpreter that has
sglang installed.

    .venv/bin/python bench/bench_client.py [--requests 400] [--concurrency 1,8,32] [--repeats 3]
        [--sglang-python /path/to/sglang-venv/bin/python]

Ours: CPU time of the process around `run_point` (metrics included). Theirs: the CLI's own
"Request throughput" line, and the CPU time of its `benchmark()` coroutine (requests and metrics,
not the interpreter's start-up), per request. Both keep at most --concurrency requests in flight.
Prints medians over repeats and the ratio ours / theirs (higher req/s, lower CPU is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: the server process

SERVER = r'''
import json, socket, sys, asyncio
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
import uvicorn

CHUNKS = 16

async def health(request):
    return JSONResponse({"status": "ok"})

async def generate(request):
    body = await request.json()
    n = int(body.get("sampling_params", {}).get("max_new_tokens", CHUNKS))
    async def chunks():
        for i in range(1, n + 1):
            meta = {"prompt_tokens": 8, "completion_tokens": i, "spec_verify_ct": i,
                    "finish_reason": {"type": "length"} if i == n else None}
            yield b"data: " + json.dumps({"text": "x" * i, "meta_info": meta}).encode() + b"\n\n"
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")

async def server_info(request):
    return JSONResponse({"internal_states": [{"avg_spec_accept_length": None}]})

async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "demo", "object": "model"}]})

app = Starlette(routes=[Route("/health", health), Route("/server_info", server_info), Route("/v1/models", models),
                        Route("/generate", generate, methods=["POST"])])
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP); sock.bind(("127.0.0.1", 0)); sock.listen(512)
port = sock.getsockname()[1]
config = uvicorn.Config(app, log_level="error", access_log=False)
server = uvicorn.Server(config)
print(json.dumps({"event": "listening", "url": f"http://127.0.0.1:{port}"}), flush=True)
server.run(sockets=[sock])
'''


def start_server(log_path: str):
    """The trivial server above as a subprocess (tests/support/server.py's ServerProcess)."""
    from tests.support.server import ServerProcess

    return ServerProcess([sys.executable, "-c", SERVER], Path(log_path), timeout_s=60, env={})


def ours(url: str, n: int, concurrency: int) -> tuple[float, float]:
    from ddtree.engine.serving.bench import BenchConfig, run_point
    from ddtree.engine.serving.prompts import Prompt

    prompts = [Prompt(f"prompt {i}") for i in range(n)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = run_point(url, prompts, BenchConfig(concurrency=concurrency, max_new_tokens=16))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert result.metrics["requests_ok"] == n, result.metrics["failures"]
    return n / wall, cpu / n


# SGLang's CLI run unmodified, with its benchmark() coroutine timed in CPU seconds so that the
# interpreter's start-up (torch, transformers) and the dataset build are not charged to it.
THEIRS = r'''
import sys, time
import sglang.benchmark.serving as serving
inner = serving.benchmark
async def timed(*args, **kwargs):
    cpu0 = time.process_time()
    try:
        return await inner(*args, **kwargs)
    finally:
        print("DDTREE_BENCH_CPU_S", time.process_time() - cpu0, flush=True)
serving.benchmark = timed
sys.argv[0] = "sglang.benchmark.serving"
serving.cli_main()
'''


def theirs(python: str, url: str, n: int, concurrency: int, tokenizer: str) -> tuple[float, float]:
    """One run of SGLang's CLI: (its printed request throughput, CPU seconds per request)."""
    argv = [python, "-c", THEIRS, "--backend", "sglang", "--base-url", url,
            "--model", "demo", "--tokenizer", tokenizer, "--dataset-name", "random-ids",
            "--random-input-len", "8", "--random-output-len", "16", "--random-range-ratio", "1",
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--warmup-requests", "1",
            "--disable-tqdm", "--output-file", os.devnull]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"})
    found = dict(re.findall(r"^(Successful requests|Request throughput \(req/s\)|DDTREE_BENCH_CPU_S):?\s+([\d.]+)",
                            done.stdout, re.M))
    if done.returncode != 0 or int(found.get("Successful requests", -1)) != n or "DDTREE_BENCH_CPU_S" not in found:
        raise SystemExit(f"sglang.benchmark.serving failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    # Its timed coroutine also ran the warm-up request: charge it to them, one of n+1.
    return float(found["Request throughput (req/s)"]), float(found["DDTREE_BENCH_CPU_S"]) / (n + 1)


def sglang_python(given: str | None) -> str | None:
    for python in [given, os.environ.get("DDTREE_SGLANG_PYTHON"), sys.executable]:
        if python and subprocess.run([python, "-c", "import sglang.benchmark.serving"], capture_output=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"}).returncode == 0:
            return python
    if given:
        raise SystemExit(f"error: {given} cannot import sglang.benchmark.serving")
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated (default: 1,8,32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sglang-python", help="interpreter with sglang installed (default: $DDTREE_SGLANG_PYTHON, then this one)")
    args = p.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    other = sglang_python(args.sglang_python)
    tokenizer = str(Path(__file__).resolve().parents[1] / "assets" / "demo" / "target")
    server = start_server(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-client-{os.getpid()}.log"))
    url = server.url
    n = args.requests
    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        ours(url, 32, 8)  # warm-up
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            for c in concurrencies:
                rows.setdefault((c, "ours"), []).append(ours(url, n, c))
                if other is not None:
                    rows.setdefault((c, "sglang.benchmark.serving"), []).append(theirs(other, url, n, c, tokenizer))
    finally:
        server.stop(10)
    print(f"{n} requests x 16 chunks each, median of {args.repeats}; higher req/s and lower CPU are better")
    if other is None:
        print("  sglang.benchmark.serving: not installed here (pass --sglang-python to compare)")
    for c in concurrencies:
        med = {}
        for name in ("ours", "sglang.benchmark.serving"):
            vals = rows.get((c, name))
            if vals:
                med[name] = (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
                print(f"  c={c:<4d} {name:26s} {med[name][0]:8.1f} req/s   {med[name][1] * 1e3:6.2f} ms client CPU per request")
        if len(med) == 2:
            a, b = med["ours"], med["sglang.benchmark.serving"]
            print(f"  c={c:<4d} ratio ours/theirs: req/s x{a[0] / b[0]:.2f}, CPU per request x{a[1] / b[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
