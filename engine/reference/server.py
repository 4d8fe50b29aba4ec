"""The builtin engine's HTTP server: the subset of SGLang's API in docs/design.md, over starlette + uvicorn.

    python -m ddtree.engine.reference.server [--model DIR|REPO] [--draft DIR|REPO]
        [--algorithm ar|dflash|ddtree] [--budget M] [--block-size B] [--device cpu|cuda]
        [--backend auto|fast|transformers] [--host 127.0.0.1] [--port 0]

Startup: start the engine process (--engine-loop process, the default; engine_loop.py), which
loads the engine and warms it up (the fast backend on CUDA captures its CUDA graphs here, each
step printed on stdout as `{"event": "warmup", "message": ...}`); then bind the socket (port 0 = a free
port, bound here and handed to uvicorn so nobody can take it in between), start serving, then print
one line on stdout: `{"event": "listening", "host": ..., "port": N, "url": "http://HOST:N",
"backend": "fast"|"transformers"}`. /health answers only from then on. SIGTERM/SIGINT: stop
accepting, let in-flight requests finish (up to --graceful-timeout), stop the engine, exit 0. An
engine process that dies fails the requests it held, and the server exits 1 with one error line.

Endpoints: /health, /server_info (= /get_server_info), /get_model_info, /generate, /v1/completions,
/v1/chat/completions, /v1/models, /metrics. Requests run on one engine thread in the engine
process (with --engine-loop thread, in this one), interleaved round by round (scheduler.py); with
--batch (the default) each round drafts and verifies all running requests in one forward each
(batch.py). Bad requests get 400 with SGLang's JSON error shape; a full queue gets 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.params import GenParams, SpecParams
from ddtree.engine.reference.scheduler import EngineThread, QueueFull, ShuttingDown, render_metrics
from ddtree.engine.reference import engine_loop
from ddtree.engine.reference.access import AccessLog, access_log
from ddtree.engine.reference.http_workers import HttpWorkers
from ddtree.engine.reference.api import DEFAULT_BUDGET, Api, BadRequest, Reply, ServerConfig
from ddtree.engine.serving.launch import BUILTIN_MODULE, MAX_HTTP_WORKERS, add_builtin_options
from ddtree.engine.serving.names import display_name

if TYPE_CHECKING:  # torch: an HTTP process with the engine in another never loads it
    from ddtree.engine.reference.engine import Engine

log = logging.getLogger("ddtree.engine.server")


# -- HTTP ----------------------------------------------------------------------------------------

def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "PayloadTooLarge",
            503: "ServiceUnavailable"}
    return JSONResponse({"object": "error", "message": message, "type": kind.get(status, "InternalServerError"),
                         "param": None, "code": status}, status_code=status)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that always releases its request, however the stream ends.

    Starlette leaves the body generator suspended (not closed) when the client vanishes while a
    chunk is being sent, so cleanup cannot live only in the generator's finally.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def stream_response(self, send: Any) -> None:
        # Starlette's, except that the chunk ending in SSE_DONE is the body's last: it goes with
        # more_body False, so the end of the response costs no write of its own. A request's
        # final chunk carries its SSE_DONE for the same reason (the chunks() of build_app).
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False
            async for chunk in self.body_iterator:  # run to its end, so that its finally runs now
                ended = chunk.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.on_close()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # Starlette runs the stream and its disconnect listener in an anyio task group, whose
        # scopes and spawning were about 13% of the HTTP process's CPU at a few tokens a request
        # (py-spy, bench/RESULTS.md). Two plain tasks that end each other do the same.
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        streaming = loop.create_task(self.stream_response(send))
        listening = loop.create_task(self.listen_for_disconnect(receive))
        streaming.add_done_callback(lambda _: listening.cancel())
        listening.add_done_callback(lambda _: streaming.cancel())
        try:
            # wait() leaves the stream alone when this task is cancelled, so a CancelledError here
            # is always this task's own (a shutdown), never the stream's ended by the listener.
            await asyncio.wait((streaming,))
        except asyncio.CancelledError:
            streaming.cancel()
            listening.cancel()
            await asyncio.wait((streaming, listening))  # the request released before this ends
            raise
        if streaming.cancelled():
            listening.result()  # the client left: nothing, or what receive() raised
            return
        streaming.result()
        if self.background is not None:
            await self.background()


# A request body at most this large: a 40k-token prompt as input_ids is about 300 kB of JSON.
MAX_BODY_BYTES = 16 * 1024 * 1024
# A body up to this size (about 1k tokens of prompt) is parsed, and its prompt tokenized, on the
# event loop: for a short request a hop to a worker thread (a wake-up and GIL hand-offs) costs
# more than the work. Larger ones go to a thread, so a long prompt never stalls /health or the
# streams.
INLINE_BODY_BYTES = 4 * 1024


async def _off_loop(size: int, fn: Any, *args: Any) -> Any:
    """fn(*args) on a worker thread when its input is larger than INLINE_BODY_BYTES, else here."""
    if size <= INLINE_BODY_BYTES:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


async def _json_body(request: Request) -> tuple[dict, int]:
    """The request's JSON object and its size in bytes, parsed off the event loop when large;
    413 past MAX_BODY_BYTES, read or declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(413, f"request body of {int(declared)} bytes exceeds {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPException(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    body = await _off_loop(size, _parse_json, b"".join(chunks))
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body, size


# Where a lone UTF-16 surrogate can come from in a UTF-8 body: a \uD800-\uDFFF escape (a valid
# pair becomes one character), or its three UTF-8 bytes, which json.loads decodes with
# "surrogatepass". A UTF-16 or UTF-32 body (json.loads takes those too) is always looked through.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _parse_json(raw: bytes):
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except ValueError:  # past Python's int_max_str_digits (4300): no count or seed is that long
        raise BadRequest("malformed JSON: a number has more digits than any field takes") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    maybe = _MAYBE_SURROGATE.search(raw) or json.detect_encoding(raw) not in ("utf-8", "utf-8-sig")
    if maybe and _has_lone_surrogate(body):
        # Not text: the tokenizer refuses it, and a reply that echoes it (a model name, a rid)
        # cannot be encoded as UTF-8.
        raise BadRequest("malformed JSON: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                         "which is not Unicode text")
    return body


def _has_lone_surrogate(body: Any) -> bool:
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def _collect(run: Reply, request: Request) -> Reply:
    """Runs a non-streaming request to the end, cancelling it if the client disconnects."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                run.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        async for _ in run.updates():
            pass
    finally:
        watcher.cancel()
    return run


def build_app(api: Api) -> Starlette:
    async def health(request: Request) -> Response:
        if api.draining:
            return _error(503, "the server is shutting down")
        if api.scheduler.failure is not None:
            return _error(503, api.scheduler.failure)
        return JSONResponse({"status": "ok"})

    async def server_info(request: Request) -> Response:
        engine, config = api.engine, api.config
        snap = await api.snapshot()
        stats = snap.stats
        return JSONResponse({
            "engine": "builtin",
            "version": _version(),
            "model": config.served_model_name, "model_path": config.model_path,
            "served_model_name": config.served_model_name,
            # the name a user knows the drafter by; its folder is speculative_draft_model_path
            "draft_model": display_name(engine.draft_name) if engine.draft_name else None,
            "speculative_draft_model_path": config.draft_path,
            "algorithm": config.algorithm, "budget": config.budget, "block_size": engine.block_size,
            "max_budget": engine.max_budget, "device": str(engine.device),
            "backend": engine.backend, "backend_reason": engine.backend_reason, "cuda_graphs": engine.graphs,
            "attention_kernel": engine.attention, "cpu_threads": engine.cpu_threads,
            "cublas_workspace": engine.cublas_workspace,  # fast/blas.py
            "speculative_algorithm": None if config.algorithm == "ar" else config.algorithm.upper(),
            "speculative_ddtree_budget": config.budget if config.algorithm == "ddtree" else None,
            "speculative_dflash_block_size": engine.block_size,
            "speculative_num_draft_tokens": engine.block_size,
            "context_length": engine.context_window,
            "max_running_requests": config.max_running, "max_queued_requests": config.max_queued,
            "batch": config.batch, "engine_loop": api.engine_loop,
            "engine_outbox": getattr(engine, "outbox", None),  # engine_loop.outbox_mode, with its own process
            "tokenizer_worker_num": getattr(api.scheduler, "workers", 1),
            "http_pid": os.getpid(),  # which HTTP process answered (with several, each has its own)
            "chunked_prefill_size": engine.prefill_chunk or -1,
            "enable_mixed_chunk": engine.mixed_chunk,
            # the pool's rounds run ahead of the host (fast/batch_graph.py), and under the same
            # switch a lone greedy AR request's steps (fast/step_ahead.py); SGLang's flag turns it off
            "disable_overlap_schedule": not engine.round_ahead,
            "max_prefill_tokens": engine.max_prefill_tokens,
            "stream_interval": config.stream_interval,
            "incremental_streaming_output": config.incremental_streaming_output,
            "kv_pool": snap.pool,
            "chat_template": "model" if api.has_chat_template else "fallback",
            "uptime_s": time.time() - api.started_at,
            "internal_states": [{
                "avg_spec_accept_length": stats.avg_accept_length,
                "recent_spec_accept_length": stats.recent_accept_length,
                "recent_spec_accept_rate": stats.recent_accept_rate,
                "last_gen_throughput": stats.gen_throughput,
                "num_running_reqs": snap.running, "num_queue_reqs": snap.queued,
                "spec_verify_calls_total": stats.verify_calls_total,
                "generation_tokens_total": stats.generation_tokens_total,
                "batched_rounds_total": stats.batched_rounds_total,
                "avg_batch_size": stats.avg_batch_size,
                "scheduler_turns_total": stats.turns_total,
                "scheduler_turn_seconds_total": stats.turn_seconds_total,
                "engine_seconds_total": stats.engine_seconds_total,
                "late_triton_compiles": snap.late_compiles,
            }],
        })

    async def metrics(request: Request) -> Response:
        body = render_metrics(await api.snapshot(), {"model_name": api.config.served_model_name})
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def model_info(request: Request) -> Response:
        # SGLang's (its frontend's RuntimeEndpoint reads it on connecting); the tokenizer is the
        # target's own.
        return JSONResponse({"model_path": api.config.model_path, "tokenizer_path": api.config.model_path,
                             "is_generation": True, "preferred_sampling_params": None, "weight_version": "default"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": api.config.served_model_name, "object": "model", "created": int(api.started_at),
            "owned_by": "ddtree-console", "root": display_name(api.config.model_path),
            "max_model_len": api.engine.context_window}]})

    async def generate(request: Request) -> Response:
        # Parsing tokenizes the prompt: a long one on a thread (_off_loop).
        body, size = await _json_body(request)
        req = await _off_loop(size, api.parse_generate, body)
        run = api.submit(req)
        await run.admission()  # a refusal is still this response's status (503)
        if not req.stream:
            await _collect(run, request)
            return JSONResponse({"text": run.text, "output_ids": run.ids,
                                 "meta_info": api.meta_info(req, run, final=True)})

        async def chunks() -> AsyncIterator[bytes]:
            # Each chunk carries all the text and ids so far, or with --incremental-streaming-output
            # only what is new: at 512 tokens the whole so far made every chunk ~2 kB of JSON.
            text_sent = ids_sent = 0
            try:
                async for r in run.updates():
                    if api.config.incremental_streaming_output:
                        text, ids = r.text[text_sent:], r.ids[ids_sent:]
                        text_sent, ids_sent = len(r.text), len(r.ids)
                    else:
                        text, ids = r.text, list(r.ids)
                    piece = _sse({"text": text, "output_ids": ids, "meta_info": api.meta_info(req, r, final=r.done)})
                    yield piece + SSE_DONE if r.done else piece  # updates() ends after done
            except EngineError as exc:
                yield _sse({"error": {"message": str(exc)}}) + SSE_DONE

        return _EventStream(chunks(), run.cancel)

    async def completions(request: Request) -> Response:
        return await _openai(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _openai(request, chat=True)

    async def _openai(request: Request, *, chat: bool) -> Response:
        body, size = await _json_body(request)
        parse = partial(api.parse_openai, body, chat=chat)
        # A chat template renders on a thread whatever the body's size: its cost need not follow it.
        req = await (run_in_threadpool(parse) if chat else _off_loop(size, parse))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        model = body.get("model") or api.config.served_model_name
        rid = ("chatcmpl-" if chat else "cmpl-") + req.rid
        created = int(time.time())
        run = api.submit(req)
        await run.admission()  # a refusal is still this response's status (503)

        def usage() -> dict:
            n_in, n_out = len(req.input_ids), len(run.ids)
            return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

        def finish() -> str | None:
            return run.finish_reason if run.finish_reason in ("stop", "length") else None

        if not req.stream:
            await _collect(run, request)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": run.text},
                          "logprobs": None, "finish_reason": finish()}
            else:
                choice = {"index": 0, "text": run.text, "logprobs": None, "finish_reason": finish()}
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": model, "choices": [choice], "usage": usage()})

        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish_reason: str | None, *, role: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
            return _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]})

        async def chunks() -> AsyncIterator[bytes]:
            sent = 0
            try:
                if chat:
                    yield chunk("", None, role=True)
                last = b""
                async for r in run.updates():
                    delta = r.text[sent:]
                    sent = len(r.text)
                    if r.done:
                        last = chunk(delta, finish())
                    elif delta:
                        yield chunk(delta, None)
                if include_usage:
                    last += _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                                  "usage": usage()})
                yield last + SSE_DONE
            except EngineError as exc:
                yield _sse({"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}) + SSE_DONE

        return _EventStream(chunks(), run.cancel)

    async def on_engine_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, (QueueFull, ShuttingDown)):
            return _error(503, str(exc))
        if isinstance(exc, EngineError) and exc.exit_code == 2:
            return _error(400, str(exc))
        log.error("request failed: %s", exc)
        return _error(500, str(exc))

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        return _error(exc.status_code, exc.detail)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error")  # boundary: a bug must cost one request, not the server
        return _error(500, f"internal error: {exc}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        api.scheduler.start()
        try:
            yield
        finally:
            api.scheduler.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={EngineError: on_engine_error, HTTPException: on_http_error,
                                         Exception: on_unexpected})


def _version() -> str:
    try:
        return version("ddtree-console")
    except PackageNotFoundError:
        return "unknown"


# -- process -------------------------------------------------------------------------------------

def bind_socket(host: str, port: int, *, shared: bool = False, listen: bool = True) -> socket.socket:
    """Binds (host, port) now; port 0 picks a free one with no window for another process to take it.
    listen False: bound only (bind_shared's check), so nothing can connect to it.

    shared: with SO_REUSEPORT, for the HTTP workers (--tokenizer-worker-num), each of which binds
    its own socket to the port: the kernel then spreads new connections over them by address
    hash. On one shared socket the process that woke first accepted a whole burst of them
    (asyncio accepts until the backlog is empty): 2 workers at c=32 put 70 of 98 us a token in
    one (bench/RESULTS.md)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BadRequest(f"cannot resolve host {host!r}: {exc}") from None
    family, _, proto, _, address = infos[0]
    # The protocol must be IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on
    # accepted sockets whose proto says TCP. With Nagle on, each streamed chunk written right after
    # another waits for the client's delayed ACK: 40 ms on the first token of every request sent
    # over a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise EngineError(f"cannot listen on {host}:{port}: {exc.strerror}", hint="pick another --port, or 0") from None
    if listen:
        sock.listen(128)
    sock.set_inheritable(True)
    return sock


# Batch rounds across requests unless told otherwise, on every device. On CUDA a forward over k
# requests costs about one request's (weight streaming dominates). On a 2-core CPU it pays too:
# bench/bench_server.py --threads 1 on the demo pair (three runs on a shared, loaded box) measured
# batched over unbatched output tok/s of x1.4-2.3 at concurrency 4 and x1.8-2.6 at 8 (ar, dflash,
# ddtree), with lower TTFT p50; concurrency 1 runs the same code either way.
DEFAULT_BATCH = True


def print_progress(message: str) -> None:
    """One warm-up step on stdout, as a JSON line: whoever waits for the `listening` line skips it."""
    print(json.dumps({"event": "warmup", "message": str(message)}), flush=True)


def warm_up(engine: Engine, config: ServerConfig, progress=print_progress) -> None:
    """The backend's own warm-up (CUDA graph capture on the fast backend), then short generations
    (alone, and two batched), so the first real requests do not pay for lazy initialisation.

    With CUDA graphs, one generation alone per kind a request may ask for (ar, dflash, and ddtree
    at each captured budget), not only the server's default, so whatever a kind does first (its
    first prefill with features, its first tree at each bucket) happens before /health turns 200.
    The tree builds of every draft depth are the backend's warm-up's (FastPath._tree_graphs):
    those were what stalled the demo pair's first one-session DDTree-64 requests on an H200."""
    # --budget is what a DDTree request without a budget gets, whatever the default algorithm.
    drafts = config.algorithm == "ddtree" or engine.draft_name is not None
    budgets = set(config.capture_budgets) | ({config.budget} if drafts and config.budget > 0 else set())
    engine.warmup(progress=progress, budgets=tuple(sorted(budgets)))
    # A target without a tokenizer serves token ids (input_ids) only: warm up on its EOS ids.
    text = engine.tokenizer.encode("def main():\n    ") if engine.tokenizer is not None else []
    ids = list(text) or list(engine.eos_token_ids or [0])
    gen = GenParams(max_new_tokens=8, temperature=0.0)
    spec = SpecParams(algorithm=config.algorithm, budget=config.budget)
    kinds = {(config.algorithm, config.budget if config.algorithm == "ddtree" else 0): spec}
    if engine.graphs:
        extra = [("ar", 0)]
        if engine.draft_name is not None:
            extra += [("dflash", 0)] + [("ddtree", b) for b in sorted(budgets)]
        for algorithm, budget in extra:
            kinds.setdefault((algorithm, budget), SpecParams(algorithm, budget or config.budget))
    for (algorithm, budget), kind in kinds.items():
        engine.generate(ids, gen, kind)
        if kind is not spec:
            progress(f"warmed up {algorithm}{f' at budget {budget}' if algorithm == 'ddtree' else ''} "
                     f"with a generation of {gen.max_new_tokens} tokens")
    if config.batch:
        _warm_batch(engine, [ids, ids[:1] + ids], gen, spec)
        # Then two drafting prompts together, each longer than a draft block, on pool slots:
        # their drafter rows go in through the batched append (fast/batch.py append_prompts), as
        # a burst of joiners' do (a c=64 DFlash burst once stalled 851 ms on an H200 before this
        # was warmed up; the cause is not confirmed, bench/RESULTS.md).
        longer = ids * (engine.block_size // max(1, len(ids)) + 2)
        slots = (engine.pool_usage() or {}).get("slots", 0)
        if (engine.draft_name is not None and not engine.hybrid_reason and slots >= 2
                and len(longer) + len(ids) + gen.max_new_tokens <= engine.context_window):
            drafting = spec if spec.algorithm != "ar" else SpecParams("dflash")
            _warm_batch(engine, [longer, longer + ids], gen, drafting)
    if engine.graphs:
        from ddtree.engine.reference.fast.graphs import watch_late_compiles

        if watch_late_compiles(log):
            progress("from now on, a Triton kernel compiled while serving is logged as a warning")


def _warm_batch(engine: Engine, prompts: list[list[int]], gen: GenParams, spec: SpecParams) -> None:
    """These prompts decoded together, batched round by round; their sessions closed whatever
    happens."""
    sessions = []
    try:
        for prompt in prompts:
            sessions.append(engine.start(prompt, gen, spec))
        while not all(s.done for s in sessions):
            engine.step_many([s for s in sessions if not s.done])
    finally:
        for s in sessions:
            s.close()


def _uvicorn_server(app: Starlette, api: Api, announce: Any, graceful_timeout_s: float, on_signal: Any = None,
                    quiet_after: bool = False) -> Any:
    """uvicorn's server for `app` with our signal handling: a first SIGINT or SIGTERM drains (and
    calls on_signal: the HTTP workers drain with it), a second SIGINT stops at once. quiet_after
    (an HTTP worker): once it has stopped serving, SIGINT and SIGTERM are ignored, so the group's
    signal and the server's, arriving apart, cannot kill a worker that is exiting cleanly."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                announce()

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            # uvicorn re-raises a caught SIGTERM after its graceful shutdown, which would turn our
            # clean exit into death by signal; we handle the signals ourselves instead.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, signal.SIG_IGN if quiet_after else handler)

        def on_signal(self, sig: int, frame: Any) -> None:
            api.draining = True
            if on_signal is not None:
                on_signal()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    # uvicorn's access log stays off: AccessLog writes ours, one line per request, polls left out.
    config = uvicorn.Config(AccessLog(app), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=graceful_timeout_s, timeout_keep_alive=30)
    return Server(config)


def _budget_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected budgets like 16,64, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"budgets must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {BUILTIN_MODULE}",
                                description="The builtin DFlash/DDTree engine behind an SGLang-compatible HTTP API.")
    add_builtin_options(p, passthrough=False, default_budget=DEFAULT_BUDGET)
    p.add_argument("--served-model-name", default=None, help="the model name the OpenAI endpoints report")
    p.add_argument("--capture-budgets", type=_budget_list, default=(),
                   help="fast backend on CUDA: DDTree budgets (comma-separated) whose graphs are captured, at "
                        "every draft depth, and run once before /health turns 200, besides --budget's; other "
                        "budgets capture on their first round, which then waits for it")
    p.add_argument("--graceful-timeout", type=float, default=60.0,
                   help="seconds in-flight requests get to finish after SIGTERM (default: 60)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    # Set by the server for the HTTP workers it starts (--tokenizer-worker-num): the port, the
    # engine socket's fd, the server's pid, the fd of the pipe it says it serves on.
    p.add_argument("--http-worker-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trace-turns", metavar="PATH", default=None,
                   help="append one JSON line per scheduler turn to PATH: its seconds and those inside the "
                        "engine, the requests it admitted, started and ran, the first tokens and tokens it "
                        "committed, how it stepped them, where a turn of prefills beside a round spent its "
                        "time, its writes to the HTTP side during the GPU's work and the wait left after them, and "
                        "any garbage collection's time in it (bench/turn_trace.py reads it); off by default")
    return p


def cpu_threads(args: argparse.Namespace, torch_default: int, usable: int | None = None) -> int | None:
    """torch's CPU threads for the rounds: --threads, else on a CPU one less than the usable CPUs
    and never more than torch's own choice (`torch_default`: its physical cores, so no
    hyperthreads), at least 1; else None (torch's choice: on CUDA, or where OMP_NUM_THREADS says).

    A round's CPU threads all wait for the slowest, and OpenMP's idle ones spin: when the HTTP
    side, the sweep client or other work holds one of the cores, every round waits for it. On a
    2-core box beside one busy process, the demo pair through this server gave 3-14 tok/s with 2
    threads and 120-200 with 1; idle, the two were within 13% of each other either way
    (bench/RESULTS.md, "torch's threads"; only a 2-core box was measured)."""
    if args.threads is not None:
        return args.threads
    if not str(args.device).startswith("cpu") or os.environ.get("OMP_NUM_THREADS"):
        return None
    if usable is None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch_default, usable - 1))


def _load(args: argparse.Namespace) -> tuple[Engine, str, str | None]:
    """Loads the engine (on the engine thread: see prepare and scheduler.EngineThread)."""
    import torch

    threads = cpu_threads(args, torch.get_num_threads())
    if threads is not None:
        torch.set_num_threads(threads)
    model, draft = args.model, args.draft
    if model is None:
        from ddtree.engine.demo import demo_paths

        demo_target, demo_drafter = demo_paths()
        model = str(demo_target)
        draft = draft or str(demo_drafter)
    dtype = None
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    pool_bytes = None if args.kv_pool_gb is None else int(args.kv_pool_gb * 2**30)
    # The fast backend batches in place from one KV pool: one slot per request it runs at once.
    from ddtree.engine.reference.engine import Engine

    engine = Engine.load(model, draft, device=args.device, dtype=dtype, backend=args.backend,
                         context_window=args.context_window,
                         pool_slots=args.max_running_requests if batch else 0, pool_bytes=pool_bytes)
    # A target with recurrent layers prefills whole (Session.chunked_prefill), and says so.
    engine.prefill_chunk = 0 if engine.hybrid_reason else max(0, args.chunked_prefill_size)
    engine.mixed_chunk = bool(args.enable_mixed_chunk) and engine.prefill_chunk > 0
    if engine.backend == "fast":
        engine.impl.round_ahead = not args.disable_overlap_schedule
    engine.max_prefill_tokens = args.max_prefill_tokens
    engine.cpu_threads = torch.get_num_threads()
    if args.block_size is not None and args.block_size != engine.block_size:
        # A shorter block drafts fewer positions per round (SGLang's --speculative-dflash-block-size);
        # the drafter has no causal mask inside a block, so any length up to the trained one works.
        if engine.draft_name is None:
            raise BadRequest("--block-size needs a drafter (--draft)")
        if args.block_size > engine.block_size:
            raise BadRequest(f"--block-size {args.block_size} exceeds the drafter's block size {engine.block_size}",
                             hint="the drafter was trained for blocks of at most that length")
        engine.block_size = args.block_size
    return engine, str(model), None if draft is None else str(draft)


def check_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range options before anything loads."""
    if args.port < 0 or args.port > 65535:
        raise BadRequest(f"--port must be in 0..65535, got {args.port}")
    if args.block_size is not None and args.block_size < 2:
        raise BadRequest(f"--block-size must be at least 2, got {args.block_size}")
    if args.context_window is not None and args.context_window < 2:
        raise BadRequest(f"--context-window must be at least 2, got {args.context_window}")
    if args.threads is not None and args.threads < 1:
        raise BadRequest(f"--threads must be at least 1, got {args.threads}")
    if args.kv_pool_gb is not None and not args.kv_pool_gb > 0:
        raise BadRequest(f"--kv-pool-gb must be a positive number, got {args.kv_pool_gb}")
    if args.max_running_requests < 1:
        raise BadRequest(f"--max-running-requests must be at least 1, got {args.max_running_requests}")
    if args.max_queued_requests < 0:
        raise BadRequest(f"--max-queued-requests must be at least 0, got {args.max_queued_requests}")
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        raise BadRequest(f"--chunked-prefill-size must be -1 (prefill whole) or a positive number of tokens, "
                         f"got {args.chunked_prefill_size}")
    if args.max_prefill_tokens < 1:
        raise BadRequest(f"--max-prefill-tokens must be at least 1, got {args.max_prefill_tokens}")
    if args.stream_interval < 1:
        raise BadRequest(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if not 1 <= args.tokenizer_worker_num <= MAX_HTTP_WORKERS:
        raise BadRequest(f"--tokenizer-worker-num must be in 1..{MAX_HTTP_WORKERS}, got {args.tokenizer_worker_num}")
    if args.tokenizer_worker_num > 1 and args.engine_loop != "process":
        raise BadRequest("--tokenizer-worker-num above 1 needs --engine-loop process",
                         hint="the HTTP processes share an engine process; with --engine-loop thread there is none")
    if args.trace_turns is not None:
        try:  # the engine thread opens it after the load: a bad path fails here, not then
            with open(args.trace_turns, "a"):
                pass
        except OSError as exc:
            raise BadRequest(f"--trace-turns: cannot write {args.trace_turns} ({exc.strerror or exc})") from None


def freeze_gc() -> None:
    """Once a server process is ready: collect once, then leave every object alive now (the
    model, its graphs, torch's and the web stack's own: some 10^5 to 10^6) out of every later
    collection (gc.freeze, as SGLang's freeze_gc). A full collection walks them all: 134 ms on a
    2-core CPU with the demo pair loaded. With the freeze, a 1.7B server's collections on an H100
    took at most 2.6 ms of a turn (bench/RESULTS.md). Only objects made later are scanned; those
    alive now stay for good, which a server's model, graphs and code do anyway."""
    gc.collect()
    gc.freeze()


def prepare(args: argparse.Namespace, engine_thread: EngineThread) -> tuple[Engine, ServerConfig]:
    """Load the engine, settle the server's configuration, warm up: all on `engine_thread`."""
    engine, model_path, draft_path = engine_thread.call(_load, args)
    config = settle_config(args, engine, model_path, draft_path)
    engine_thread.call(warm_up, engine, config)
    return engine, config


def settle_config(args: argparse.Namespace, engine: Engine, model_path: str, draft_path: str | None) -> ServerConfig:
    """The server's configuration from its options and the loaded engine (budget, algorithm and
    running requests follow what the engine can do)."""
    # A target served without a drafter has max_budget 0: the default must follow it down, not up.
    default_budget = DEFAULT_BUDGET if engine.max_budget is None else min(DEFAULT_BUDGET, engine.max_budget)
    budget = args.budget if args.budget is not None else default_budget
    if engine.max_budget is not None and not 0 <= budget <= engine.max_budget:
        raise BadRequest(f"--budget must be between 0 and {engine.max_budget}, got {budget}")
    algorithm = args.algorithm if engine.draft_name is not None else "ar"
    max_running = args.max_running_requests
    pool = engine.pool_usage()
    if pool is not None and pool["slots"] < max_running:
        log.warning("the KV pool holds %d requests: running at most %d at once (--max-running-requests %d)",
                    pool["slots"], pool["slots"], max_running)
        max_running = pool["slots"]
    if args.algorithm != "ar" and engine.draft_name is None:
        log.warning("no drafter loaded: serving %s requests as ar", args.algorithm)
    return ServerConfig(algorithm=algorithm, budget=budget,
                        # the name a user gave, or the repo id; never the demo's install path
                        served_model_name=args.served_model_name or display_name(model_path),
                        model_path=model_path, draft_path=draft_path,
                        max_running=max_running, max_queued=args.max_queued_requests,
                        graceful_timeout_s=args.graceful_timeout,
                        batch=DEFAULT_BATCH if args.batch is None else args.batch,
                        stream_interval=args.stream_interval, trace_turns=args.trace_turns,
                        incremental_streaming_output=bool(args.incremental_streaming_output),
                        capture_budgets=tuple(b for b in args.capture_budgets
                                              if engine.max_budget is None or b <= engine.max_budget))


def _setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def engine_loop_main(conns: list, args: argparse.Namespace, parent_pid: int) -> None:
    """The engine process (--engine-loop process): load, warm up, then run the rounds for the
    HTTP processes on the other ends of `conns` (engine_loop.host)."""
    conn = conns[0]
    engine_loop.die_with_parent(parent_pid)  # engine_loop._child already ignores SIGINT and SIGTERM
    _setup_logging(args)
    engine_thread = EngineThread()
    try:
        engine, config = prepare(args, engine_thread)
    except EngineError as exc:
        conn.send(("failed", exc.exit_code, str(exc)))
        return
    except Exception as exc:  # boundary: the HTTP process prints it as its one error line
        log.exception("loading the engine failed")
        conn.send(("failed", 1, f"loading the engine failed: {type(exc).__name__}: {exc}"))
        return
    facts = engine_loop.EngineFacts.of(engine)
    freeze_gc()
    conn.send(("ready", facts, config))
    engine_loop.host(conns, engine, config, engine_thread, greeting=(facts, config))


def bind_shared(host: str, port: int) -> socket.socket:
    """The server's socket when HTTP workers share its port (bind_socket's shared). Checked first
    without SO_REUSEPORT, so that a port another server holds (this one's twin included, which
    would otherwise share it silently) is refused as usual; port 0 picks a free one there. The
    check binds only: nothing connects to it."""
    with bind_socket(host, port, listen=False) as probe:
        port = probe.getsockname()[1]
    return bind_socket(host, port, shared=True)


#: Seconds the server waits for its HTTP workers to serve before it announces itself without them.
WORKER_START_S = 120.0


def worker_main(args: argparse.Namespace) -> int:
    """An HTTP worker (--tokenizer-worker-num; http_workers.py): serve the server's port beside
    it, through the engine socket it was handed. It exits with the server (PR_SET_PDEATHSIG) and
    prints nothing: the server announces, and says why when the engine fails."""
    try:
        return _worker(args)
    except KeyboardInterrupt:  # Ctrl-C while it starts: the server says what there is to say
        return 130


def _worker(args: argparse.Namespace) -> int:
    port, conn_fd, server_pid, ready_fd = (int(part) for part in args.http_worker_of.split(","))
    engine_loop.die_with_parent(server_pid)
    conn = Connection(conn_fd)
    try:
        conn.send(("hello",))
        message = conn.recv()
    except (EOFError, OSError):
        return 1
    _, facts, config = message
    # Listening only now, when it can serve: connections the kernel hands to its socket wait there.
    try:
        sock = bind_socket(args.host, port, shared=True)
    except EngineError as exc:  # the server serves on without this worker (and logs its exit)
        log.error("an HTTP worker could not listen: %s", exc)
        return 1
    server: Any = None

    def engine_failed(reason: str) -> None:
        if server is not None:
            server.should_exit = True

    scheduler = engine_loop.RemoteScheduler(None, conn, max_running=config.max_running, max_queued=config.max_queued,
                                            on_failure=engine_failed, workers=args.tokenizer_worker_num)
    api = Api(facts, config, None, scheduler)
    def serving() -> None:  # the server waits for this before it announces itself
        freeze_gc()
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    server = _uvicorn_server(build_app(api), api, serving, args.graceful_timeout, quiet_after=True)
    server.run(sockets=[sock])
    return 1 if scheduler.failure is not None else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    # Request lines at INFO whatever --log-level says, unless it asks for errors only: they are what
    # makes following the engine's log worth it.
    access_log.setLevel(logging.ERROR if args.log_level == "error" else logging.INFO)
    if args.http_worker_of is not None:
        return worker_main(args)
    failed: list[str] = []
    server: Any = None
    helpers: HttpWorkers | None = None

    def engine_failed(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        check_args(args)
        if args.engine_loop == "process":
            # The rounds run in a process of their own (engine_loop says why); this one
            # serves HTTP and runs no model.
            workers = args.tokenizer_worker_num
            process, conns, engine, config = engine_loop.start(f"{BUILTIN_MODULE}:engine_loop_main", args, workers)
            sock = bind_socket(args.host, args.port) if workers == 1 else bind_shared(args.host, args.port)
            if workers > 1:
                helpers = HttpWorkers(BUILTIN_MODULE, argv, sock.getsockname()[1], conns[1:])
                helpers.wait_ready(WORKER_START_S)
            scheduler = engine_loop.RemoteScheduler(
                process, conns[0], max_running=config.max_running, max_queued=config.max_queued,
                on_failure=engine_failed, workers=workers,
                before_stop=partial(helpers.stop, args.graceful_timeout + 15) if helpers else None)
            api_args: tuple = (engine, config, None, scheduler)
        else:
            # Loading, warm-up and every round run on this one thread, so torch keeps one OpenMP
            # pool (scheduler.EngineThread says why); the main thread runs the event loop.
            engine_thread = EngineThread()
            engine, config = prepare(args, engine_thread)
            api_args = (engine, config, engine_thread)
            sock = bind_socket(args.host, args.port)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while the engine loads: no traceback (the engine dies with us)
        print("error: interrupted while loading the engine", file=sys.stderr)
        return 130

    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    def announce() -> None:
        freeze_gc()
        print(json.dumps({"event": "listening", "host": host, "port": port, "url": f"http://{url_host}:{port}",
                          "backend": engine.backend}), flush=True)

    api = Api(*api_args)
    server = _uvicorn_server(build_app(api), api, announce, args.graceful_timeout,
                             on_signal=helpers.drain if helpers else None)
    server.run(sockets=[sock])
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
