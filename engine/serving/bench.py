"""The benchmark client: an async load generator for any engine with the HTTP API of docs/design.md.

It speaks SGLang's native `POST /generate` (the builtin engine and SGLang) or the OpenAI
completions API (vLLM's server), always streaming, at a fixed concurrency and optionally a
Poisson request rate. Warm-up requests run first and are left out of every figure.

Per request it records prompt/completion tokens, TTFT, inter-token latencies (a chunk carrying n
tokens counts as n gaps of 1/n of its delay, as sglang.bench_serving does), end-to-end latency,
the engine's verify count and accept length, and the cause of a failure. `point_metrics` turns a
list of requests into the point's figures. No torch here.

    result = run_point(url, prompts, BenchConfig(concurrency=4, max_new_tokens=64))
    result.metrics["output_tok_s"], result.metrics["tau_weighted"]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from ddtree.engine.serving.http import EngineNotReady, health_status, sse_payload
from ddtree.engine.errors import EngineError
from ddtree.engine.serving.metrics import MetricsError, request_acceptance
from ddtree.engine.serving.prompts import Prompt


class BenchConfigError(EngineError):
    exit_code = 2


@dataclass(frozen=True)
class BenchConfig:
    """One point's client settings. `speculative` is sent per request (builtin engine only)."""

    concurrency: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    api: str = "generate"
    request_rate: float | None = None
    warmup: int = 0
    timeout_s: float = 600.0
    seed: int = 0
    speculative: dict | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.api not in ("generate", "openai"):
            raise BenchConfigError(f"api must be 'generate' or 'openai', got {self.api!r}")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise BenchConfigError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise BenchConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise BenchConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise BenchConfigError(f"request_rate must be > 0, got {self.request_rate}")
        if self.warmup < 0 or self.timeout_s <= 0:
            raise BenchConfigError("warmup must be >= 0 and timeout_s > 0")


@dataclass
class RequestResult:
    """One request. `error` is a short cause ("timeout", "http 500", ...), `detail` the message."""

    index: int
    ok: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    verify_ct: int | None = None
    accept_length: float | None = None
    accept_hist: list[int] | None = None
    finish_reason: str | None = None
    started_at: float = 0.0
    start_offset_s: float = 0.0
    error: str | None = None
    detail: str | None = None

    @property
    def itl_mean_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None


@dataclass
class PointResult:
    requests: list[RequestResult]
    metrics: dict[str, Any]
    warnings: list[str]
    started_at: float
    ended_at: float


# -- statistics ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float]) -> float | None:
    return percentile(values, 50)


def tau_stats(requests: list[RequestResult]) -> tuple[float | None, float | None]:
    """(mean of per-request accept lengths, mean weighted by each request's verify count).

    The weighted figure is total tokens per verify round over the point, which is what decides
    throughput; the plain mean lets short requests count as much as long ones.
    """
    taus = [r.accept_length for r in requests if r.ok and r.accept_length is not None]
    mean = sum(taus) / len(taus) if taus else None
    weighted_pairs = [(r.accept_length, r.verify_ct) for r in requests
                      if r.ok and r.accept_length is not None and r.verify_ct]
    total_v = sum(v for _, v in weighted_pairs)
    weighted = sum(t * v for t, v in weighted_pairs) / total_v if total_v else None
    return mean, weighted


def merge_histograms(hists: list[list[int] | None]) -> list[int] | None:
    """Element-wise sum of accept-length histograms (index = accept length)."""
    present = [h for h in hists if h]
    if not present:
        return None
    out = [0] * max(len(h) for h in present)
    for h in present:
        for i, count in enumerate(h):
            out[i] += int(count)
    return out


def point_metrics(requests: list[RequestResult], *, concurrency: int, duration_s: float | None = None) -> dict:
    """The point's figures from its measured requests (warm-up already left out).

    Throughputs divide by the wall time from the first request's start to the last one's end.
    `tok_s_per_user` is the output tok/s shared among the requests in flight: output tok/s divided
    by the mean number of requests in flight (Little's law: the sum of E2E latencies over the wall
    time), counted as at least one. So it never exceeds output tok/s, and at concurrency 1 it equals
    it; the mean of per-request tokens / E2E did not (short requests weigh as much as long ones).
    """
    ok = [r for r in requests if r.ok]
    failed = [r for r in requests if not r.ok]
    if duration_s is None:
        ends = [r.start_offset_s + (r.e2e_s or 0.0) for r in requests]
        duration_s = max(ends) - min(r.start_offset_s for r in requests) if requests else 0.0
    output_tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itl_s]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    busy_s = sum(r.e2e_s for r in requests if r.e2e_s)
    tau_mean, tau_weighted = tau_stats(requests)
    metrics: dict[str, Any] = {
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "output_tok_s": output_tokens / duration_s if duration_s > 0 else None,
        "req_s": len(ok) / duration_s if duration_s > 0 else None,
        "tok_s_per_user": (output_tokens / duration_s / max(1.0, busy_s / duration_s)
                           if duration_s > 0 and ok else None),
        "tau_mean": tau_mean,
        "tau_weighted": tau_weighted,
        "tau_hist": merge_histograms([r.accept_hist for r in ok]),
        "failures": dict(Counter(r.error or "unknown" for r in failed)),
        "concurrency": concurrency,
    }
    for name, values in (("ttft", ttfts), ("itl", itls), ("e2e", e2es)):
        for q in (50, 90, 99):
            metrics[f"{name}_p{q}"] = percentile(values, q)
    return metrics


def spread(values: list[float]) -> float | None:
    """(max - min) / median of repeats: 0 when they agree; None when fewer than two."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    mid = median(values)
    return (max(values) - min(values)) / mid if mid else None


# -- the HTTP side -------------------------------------------------------------------------------


async def _sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON objects of an SSE stream, up to `[DONE]`; ValueError on anything else.

    The body is read to its end even after `[DONE]`, so that the connection goes back to the pool.
    """
    done = False
    async for line in response.content:
        payload = None if done else sse_payload(line)
        if payload is None:
            continue
        if payload == b"[DONE]":
            done = True
            continue
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise ValueError("stream chunk is not an object")
        yield data


def _finish_reason(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("type")
    return str(value) if value is not None else None


def _apply_meta(result: RequestResult, meta: dict) -> None:
    """Read SGLang's meta_info: token counts, verify count, accept length and histogram (through
    engine/metrics.request_acceptance, the one reader of per-request acceptance)."""
    if isinstance(meta.get("prompt_tokens"), int):
        result.prompt_tokens = meta["prompt_tokens"]
    if isinstance(meta.get("completion_tokens"), int):
        result.completion_tokens = meta["completion_tokens"]
    try:
        acceptance = request_acceptance(meta)
    except MetricsError:
        # A histogram we cannot read must not cost the verify count; without a token count
        # there is nothing to read at all.
        try:
            acceptance = request_acceptance({k: v for k, v in meta.items() if not k.endswith("_histogram")})
        except MetricsError:
            acceptance = None
    if acceptance is not None and acceptance.verify_ct:
        result.verify_ct = acceptance.verify_ct
        result.accept_length = acceptance.accept_length
    # SGLang's histogram counts rounds by accepted drafts (bonus excluded); ours is indexed by
    # accept length (bonus included), so it shifts by one.
    if acceptance is not None and acceptance.histogram:
        result.accept_hist = [0] + list(acceptance.histogram)
    if meta.get("finish_reason") is not None:
        result.finish_reason = _finish_reason(meta.get("finish_reason"))


class _Stream:
    """Token-arrival bookkeeping shared by both APIs."""

    def __init__(self, result: RequestResult, t0: float) -> None:
        self.result = result
        self.t0 = t0
        self.last_t: float | None = None
        self.last_count = 0
        self.chunks: list[tuple[float, int | None]] = []

    def tokens(self, count: int | None, now: float) -> None:
        """Record a chunk that brought the cumulative completion count to `count` (None: unknown)."""
        if count is not None and count <= self.last_count:
            return
        if self.result.ttft_s is None:
            self.result.ttft_s = now - self.t0
        else:
            self.chunks.append((now - self.last_t, None if count is None else count - self.last_count))
        self.last_t = now
        if count is not None:
            self.last_count = count

    def finish(self, total_tokens: int) -> None:
        # Chunks whose token count the API does not say (OpenAI) share the rest evenly.
        known = sum(n for _, n in self.chunks if n is not None)
        unknown = [gap for gap, n in self.chunks if n is None]
        rest = max(total_tokens - 1 - known, len(unknown))
        share = rest / len(unknown) if unknown else 0
        itl = []
        for gap, n in self.chunks:
            n = n if n is not None else share
            if n and n > 0:
                whole = max(1, round(n))
                itl.extend([gap / whole] * whole)
        self.result.itl_s = itl


async def _refused(response: aiohttp.ClientResponse, result: RequestResult) -> bool:
    if response.status < 400:
        return False
    text = (await response.read()).decode(errors="replace")[:300]
    result.error, result.detail = f"http {response.status}", text
    return True


async def _request_generate(session: aiohttp.ClientSession, url: str, prompt: Prompt, cfg: BenchConfig,
                            result: RequestResult) -> None:
    body: dict[str, Any] = {
        "text": prompt.text,
        "sampling_params": {"max_new_tokens": prompt.max_new_tokens or cfg.max_new_tokens,
                            "temperature": cfg.temperature,
                            "top_p": cfg.top_p},
        "stream": True,
    }
    if cfg.speculative:
        body["speculative"] = cfg.speculative
    t0 = time.perf_counter()
    stream = _Stream(result, t0)
    async with session.post(url + "/generate", json=body) as response:
        if await _refused(response, result):
            return
        meta: dict = {}
        if response.content_type == "application/json":
            data = json.loads(await response.read())
            meta = data.get("meta_info", {}) if isinstance(data, dict) else {}
            stream.tokens(meta.get("completion_tokens") or 1, time.perf_counter())
        else:
            async for data in _sse_chunks(response):
                if "error" in data:
                    err = data["error"]
                    result.error = "server error"
                    result.detail = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                    return
                meta = data.get("meta_info") or {}
                count = meta.get("completion_tokens")
                if not isinstance(count, int):
                    count = len(data.get("output_ids") or []) or None
                stream.tokens(count, time.perf_counter())
        result.e2e_s = time.perf_counter() - t0
        _apply_meta(result, meta)
        stream.finish(result.completion_tokens)
        result.ok = True


async def _request_openai(session: aiohttp.ClientSession, url: str, prompt: Prompt, cfg: BenchConfig,
                          result: RequestResult) -> None:
    chat = prompt.messages is not None
    body: dict[str, Any] = {"model": cfg.model or "default", "max_tokens": prompt.max_new_tokens or cfg.max_new_tokens,
                            "temperature": cfg.temperature, "top_p": cfg.top_p, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = prompt.chat()
    else:
        body["prompt"] = prompt.text
    t0 = time.perf_counter()
    stream = _Stream(result, t0)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body) as response:
        if await _refused(response, result):
            return
        async for data in _sse_chunks(response):
            if "error" in data:
                result.error, result.detail = "server error", str(data["error"])[:300]
                return
            for choice in data.get("choices") or []:
                piece = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                if piece:
                    stream.tokens(None, time.perf_counter())
                if choice.get("finish_reason"):
                    result.finish_reason = _finish_reason(choice["finish_reason"])
            usage = data.get("usage")
            if isinstance(usage, dict):
                result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
        result.e2e_s = time.perf_counter() - t0
        if not result.completion_tokens:
            result.completion_tokens = len(stream.chunks) + (1 if result.ttft_s is not None else 0)
        stream.finish(result.completion_tokens)
        result.ok = True


async def _one(session: aiohttp.ClientSession, url: str, prompt: Prompt, cfg: BenchConfig, index: int,
               t_start: float) -> RequestResult:
    result = RequestResult(index=index, started_at=time.time(), start_offset_s=time.perf_counter() - t_start)
    call = _request_generate if cfg.api == "generate" else _request_openai
    try:
        await asyncio.wait_for(call(session, url, prompt, cfg, result), timeout=cfg.timeout_s)
    except asyncio.TimeoutError:
        result.error, result.detail = "timeout", f"no complete answer within {cfg.timeout_s:g}s"
    except aiohttp.ClientConnectorError as exc:
        result.error, result.detail = "connect", str(exc) or "connection refused"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError,
            aiohttp.ClientResponseError, ConnectionError) as exc:
        result.error, result.detail = "disconnected", str(exc) or type(exc).__name__
    except (ValueError, KeyError, TypeError, AttributeError, aiohttp.ClientError) as exc:
        # json.JSONDecodeError is a ValueError: the engine sent something that is not its API.
        result.error, result.detail = "bad response", f"{type(exc).__name__}: {exc}"[:300]
    if result.error:
        result.ok = False
        if result.e2e_s is None:
            result.e2e_s = time.perf_counter() - t_start - result.start_offset_s
    return result


async def _run_requests(session: aiohttp.ClientSession, url: str, prompts: list[Prompt], cfg: BenchConfig,
                        stop: threading.Event | None) -> tuple[list[RequestResult], float, float]:
    """At most `cfg.concurrency` requests in flight: each worker takes the next prompt as soon as
    its previous request ends (and, with a request rate, once the prompt has arrived)."""
    rng = random.Random(cfg.seed)
    queue: asyncio.Queue = asyncio.Queue()
    results: list[RequestResult] = []
    t_start = time.perf_counter()

    async def arrivals() -> None:
        for i, prompt in enumerate(prompts):
            if stop is not None and stop.is_set():
                break
            if cfg.request_rate is not None and i > 0:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            queue.put_nowait((i, prompt))
        for _ in range(cfg.concurrency):
            queue.put_nowait(None)

    async def worker() -> None:
        while (item := await queue.get()) is not None:
            if stop is not None and stop.is_set():
                return
            results.append(await _one(session, url, item[1], cfg, item[0], t_start))

    pending = {asyncio.create_task(arrivals())} | {asyncio.create_task(worker()) for _ in range(cfg.concurrency)}
    while pending:
        done, pending = await asyncio.wait(pending, timeout=0.2)
        for task in done:
            task.result()
        if stop is not None and stop.is_set():
            for task in pending:
                task.cancel()
            break
    t_end = time.perf_counter()
    results.sort(key=lambda r: r.index)
    return results, t_start, t_end


def _session(cfg: BenchConfig) -> aiohttp.ClientSession:
    """aiohttp rather than httpx here: with httpx the client spent 3x the CPU per request of
    SGLang's bench_serving and became the bottleneck near 300 req/s on a 2-core box; aiohttp (what
    bench_serving uses) has a C parser and a pool that does not scan every connection per chunk
    (bench/bench_client.py measures both clients side by side)."""
    connector = aiohttp.TCPConnector(limit=cfg.concurrency + 4, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(cfg.timeout_s, 30.0))
    # read_bufsize bounds one SSE line: SGLang's /generate repeats the whole text in every chunk.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False, read_bufsize=2**20)


@contextlib.contextmanager
def _heap_frozen():
    """Leave every object alive before the point out of the collections during it (gc.freeze, as
    the builtin server's processes do once ready). A full collection walks the whole heap: with
    torch imported (a bench script, or a job beside one) that is about 0.1 s, in which no request
    is sent and no chunk read, so the server sits idle and the point's throughput and tails count
    the client's pause: the likely cause of an H200 grid's engine sitting idle 117-134 ms at a
    c=64 wave boundary (bench/RESULTS.md; not yet confirmed). A process that had frozen its heap
    itself keeps it frozen."""
    frozen_before = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


async def run_point_async(url: str, prompts: list[Prompt], cfg: BenchConfig, *,
                          warmup_prompts: list[Prompt] | None = None,
                          stop: threading.Event | None = None) -> PointResult:
    url = url.rstrip("/")
    warnings = []
    if len(prompts) < 5 * cfg.concurrency:
        warnings.append(f"num_prompts {len(prompts)} < 5 x concurrency {cfg.concurrency}: the server spends much "
                        "of the point below that concurrency; figures are noisy")
    async with _session(cfg) as session:
        if cfg.warmup:
            warm = (warmup_prompts or prompts)[: cfg.warmup]
            warm_cfg = dataclasses.replace(cfg, request_rate=None,
                                           concurrency=max(1, min(cfg.concurrency, len(warm))))
            warm_results, _, _ = await _run_requests(session, url, warm, warm_cfg, stop)
            if warm_results and not any(r.ok for r in warm_results):
                warnings.append(f"every warm-up request failed ({warm_results[0].error}: {warm_results[0].detail})")
        with _heap_frozen():
            wall_start = time.time()
            results, t_start, t_end = await _run_requests(session, url, prompts, cfg, stop)
            wall_end = time.time()
    metrics = point_metrics(results, concurrency=cfg.concurrency, duration_s=t_end - t_start)
    return PointResult(requests=results, metrics=metrics, warnings=warnings, started_at=wall_start, ended_at=wall_end)


def run_point(url: str, prompts: list[Prompt], cfg: BenchConfig, *, warmup_prompts: list[Prompt] | None = None,
              stop: threading.Event | None = None) -> PointResult:
    """Run one point to completion in a fresh event loop (call from a thread without one)."""
    return asyncio.run(run_point_async(url, prompts, cfg, warmup_prompts=warmup_prompts, stop=stop))


def wait_ready(url: str, *, timeout_s: float, alive=None, interval_s: float = 0.25) -> float:
    """Poll GET /health until 200; returns the seconds waited. `alive()` returning a message
    (the engine exited) ends the wait early with an EngineNotReady naming it."""
    url = url.rstrip("/")
    t0 = time.monotonic()
    last = "no answer yet"
    with httpx.Client(timeout=min(5.0, timeout_s), trust_env=False) as client:
        while True:
            if alive is not None:
                gone = alive()
                if gone:
                    raise EngineNotReady(f"engine exited before it was ready: {gone}")
            last = health_status(client, url) or ""
            if not last:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise EngineNotReady(f"engine at {url} not ready after {timeout_s:g}s ({last})",
                                     "raise engine.ready_timeout_s, or read the engine log")
            time.sleep(interval_s)
