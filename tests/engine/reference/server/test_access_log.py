"""The builtin server logs one line per request (streamed ones when they end), polls left out."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ddtree.engine.reference.access import AccessLog, request_line


class Ticks:
    """A clock that moves 0.25 s per read."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.25
        return self.t


def app() -> Starlette:
    async def ok(request):
        return JSONResponse({"status": "ok"})

    async def stream(request):
        async def body():
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def bad(request):
        return JSONResponse({"error": "no"}, status_code=400)

    return Starlette(routes=[Route("/health", ok), Route("/v1/completions", stream, methods=["POST"]),
                             Route("/generate", bad, methods=["POST"])])


def test_request_lines_name_method_path_status_and_time(caplog):
    logger = logging.getLogger("test.access")
    client = TestClient(AccessLog(app(), logger=logger, clock=Ticks()))
    with caplog.at_level(logging.INFO, logger="test.access"):
        client.get("/health")
        client.post("/v1/completions", json={})
        client.post("/generate", json={})
        client.get("/nowhere")
    lines = [r.getMessage() for r in caplog.records if r.name == "test.access"]
    assert lines == ["POST /v1/completions 200 0.250s", "POST /generate 400 0.250s", "GET /nowhere 404 0.250s"]


def test_a_failing_poll_is_logged():
    assert request_line("GET", "/health", 503, 0.0125) == "GET /health 503 0.013s"
    assert request_line("POST", "/generate", None, 1.0) == "POST /generate - 1.000s"
