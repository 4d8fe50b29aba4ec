"""One log line per request the builtin server answers, so the engine's log shows its traffic.

uvicorn's own access log is off (it logs at INFO through a logger the server keeps at WARNING, and
its format is not ours). This ASGI wrapper logs `METHOD PATH STATUS SECONDSs` when the response
has been sent, a streamed one included, at INFO on `ddtree.engine.server.access`. Polling
endpoints (/health, /metrics, /server_info) answered 2xx are left out: the console and a sweep
ask them every second or two, and they would drown the lines worth reading.
"""

from __future__ import annotations

import logging
import time
from typing import Any

access_log = logging.getLogger("ddtree.engine.server.access")

QUIET_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/server_info", "/get_server_info"})


def request_line(method: str, path: str, status: int | None, seconds: float) -> str:
    """`POST /v1/chat/completions 200 1.234s`; status '-' when the client left before one was sent."""
    return f"{method} {path} {status if status is not None else '-'} {seconds:.3f}s"


def quiet(path: str, status: int | None) -> bool:
    return path in QUIET_PATHS and status is not None and 200 <= status < 300


class AccessLog:
    """Wraps an ASGI app; `clock` is injectable so tests need no real time."""

    def __init__(self, app: Any, logger: logging.Logger = access_log, clock=time.perf_counter) -> None:
        self.app = app
        self.logger = logger
        self.clock = clock

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def sending(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        t0 = self.clock()
        try:
            await self.app(scope, receive, sending)
        finally:
            code = status[0] if status else None
            path = scope.get("path", "")
            if not quiet(path, code):
                self.logger.info(request_line(scope.get("method", "-"), path, code, self.clock() - t0))
