"""Is the sweep client ever the bottleneck? Requests/s and client CPU per request against a trivial
local streaming server (no model: 16 SSE chunks per request in SGLang's /generate shape), measured
side by side in one run with SGLang's bench_serving client when sglang is importable.

    .venv/bin/python bench/bench_client.py [--requests 400] [--concurrency 32] [--repeats 3]

Prints medians over repeats and the ratio ours / theirs (higher req/s, lower CPU is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time

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

app = Starlette(routes=[Route("/health", health), Route("/generate", generate, methods=["POST"])])
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(512)
port = sock.getsockname()[1]
config = uvicorn.Config(app, log_level="error", access_log=False)
server = uvicorn.Server(config)
print(json.dumps({"event": "listening", "url": f"http://127.0.0.1:{port}"}), flush=True)
server.run(sockets=[sock])
'''


def start_server(log_path: str) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=60):
        raise SystemExit("trivial server did not start; see " + log_path)
    return proc, json.loads(proc.stdout.readline())["url"]


def ours(url: str, n: int, concurrency: int) -> tuple[float, float]:
    from ddtree.engine.bench import BenchConfig, run_point
    from ddtree.engine.prompts import Prompt

    prompts = [Prompt(f"prompt {i}") for i in range(n)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = run_point(url, prompts, BenchConfig(concurrency=concurrency, max_new_tokens=16))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert result.metrics["requests_ok"] == n, result.metrics["failures"]
    return n / wall, cpu / n


def theirs(url: str, n: int, concurrency: int) -> tuple[float, float] | None:
    try:
        from sglang.bench_serving import RequestFuncInput, async_request_sglang_generate
    except ImportError:
        return None

    async def go():
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            async with sem:
                return await async_request_sglang_generate(RequestFuncInput(
                    prompt=f"prompt {i}", api_url=url + "/generate", prompt_len=8, output_len=16, model="m",
                    lora_name=None, image_data=None, extra_request_body={}))

        return await asyncio.gather(*(one(i) for i in range(n)))

    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = asyncio.run(go())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert all(o.success for o in outs)
    return n / wall, cpu / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    proc, url = start_server(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-client-{os.getpid()}.log"))
    try:
        ours(url, 32, 8)  # warm-up
        rows: dict[str, list[tuple[float, float]]] = {"ours": [], "sglang.bench_serving": []}
        for _ in range(args.repeats):
            rows["ours"].append(ours(url, args.requests, args.concurrency))
            other = theirs(url, args.requests, args.concurrency)
            if other is not None:
                rows["sglang.bench_serving"].append(other)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    print(f"{args.requests} requests x 16 chunks, concurrency {args.concurrency}, median of {args.repeats}")
    med = {}
    for name, vals in rows.items():
        if not vals:
            print(f"  {name:22s} not installed (pip install sglang to compare)")
            continue
        med[name] = (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
        print(f"  {name:22s} {med[name][0]:8.1f} req/s   {med[name][1] * 1e3:6.2f} ms client CPU per request")
    if len(med) == 2:
        a, b = med["ours"], med["sglang.bench_serving"]
        print(f"  ratio ours/theirs: req/s x{a[0] / b[0]:.2f}, CPU per request x{a[1] / b[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
