"""The product's one HTTP path to an engine: the health check and the SSE line parser.

Engines listen on loopback or a cluster address, never behind the user's web proxy, so every
client here ignores HTTP(S)_PROXY (`trust_env=False`): a proxy variable exported for pip must not
turn every health check into a proxy error.
"""

from __future__ import annotations

import httpx

from ddtree.engine.errors import EngineError


class EngineNotReady(EngineError):
    """The server did not become healthy in time (or its process exited)."""


def health(base_url: str, *, timeout_s: float = 2.0, path: str = "/health") -> bool:
    """True when GET base_url+path answers 200; False when it answers otherwise or not at all."""
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            return client.get(base_url.rstrip("/") + path).status_code == 200
    except httpx.HTTPError:
        return False


def health_status(client: httpx.Client, base_url: str, path: str = "/health") -> str | None:
    """None when the engine answers 200, else a short reason (its status or the connection error)."""
    try:
        response = client.get(base_url.rstrip("/") + path)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if response.status_code == 200 else f"GET {path} answered {response.status_code}"


def sse_payload(line: bytes | str) -> bytes | None:
    """The payload of one SSE line: None for blank lines and comments, the bytes after `data:`,
    or the line itself (SGLang's non-SSE JSON lines)."""
    if isinstance(line, str):
        line = line.encode()
    line = line.strip()
    if not line or line.startswith(b":"):
        return None
    if line.startswith(b"data:"):
        return line[5:].strip()
    return line
