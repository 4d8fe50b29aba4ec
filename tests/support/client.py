"""A small HTTP client for the engine API (the builtin server, SGLang), for tests and bench scripts.

The product talks to engines through ddtree.engine.serving.http (health, SSE lines) and the sweep's
bench client; this one covers the whole API so tests can drive a server the way a user's client does.

    EngineError                        (ddtree.engine.errors)
    └── EngineClientError              anything this module raises
        ├── EngineUnreachable          connection refused/reset, DNS, timeout
        └── EngineHTTPError            the server answered with an error status (.status, .body)
            ├── EngineBadRequest       4xx: the request was refused as bad input
            └── EngineOverloaded       503: the queue is full or the server is shutting down

Streaming calls return iterators of parsed chunks; the lines are read with the product's parser
(`sse_payload`), `[DONE]` ends a stream, and an `{"error": ...}` chunk raises EngineHTTPError.
AsyncEngineClient has only what the tests use from asyncio: generate.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx

from ddtree.engine.errors import EngineError
from ddtree.engine.serving.http import sse_payload


class EngineClientError(EngineError):
    """Base of the client's errors."""


class EngineUnreachable(EngineClientError):
    """No HTTP answer at all: nothing listening, connection reset, or timed out."""


class EngineHTTPError(EngineClientError):
    """The server answered with an error status."""

    def __init__(self, message: str, hint: str | None = None, *, status: int = 0, body: Any = None) -> None:
        super().__init__(message, hint)
        self.status = status
        self.body = body


class EngineBadRequest(EngineHTTPError):
    pass


class EngineOverloaded(EngineHTTPError):
    """503: retry later."""


_DONE = object()


def _error_from(status: int, text: str, url: str) -> EngineHTTPError:
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    message = text.strip()[:500]
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        message = str(inner.get("message") or inner.get("detail") or message)
    cls = EngineOverloaded if status == 503 else EngineBadRequest if 400 <= status < 500 else EngineHTTPError
    return cls(f"{url}: HTTP {status}: {message}", status=status, body=body)


def _unreachable(url: str, exc: Exception) -> EngineUnreachable:
    return EngineUnreachable(f"{url}: {exc.__class__.__name__}: {exc}", hint="is the server running?")


def _checked(response: httpx.Response, url: str) -> httpx.Response:
    if response.status_code >= 400:
        raise _error_from(response.status_code, response.text, url)
    return response


def _json_of(response: httpx.Response, url: str) -> Any:
    try:
        return _checked(response, url).json()
    except ValueError:
        raise EngineHTTPError(f"{url}: the answer is not JSON", status=response.status_code,
                              body=response.text[:500]) from None


def _chunk(line: str) -> Any:
    """One stream line: None to skip, _DONE at the end, else the parsed chunk."""
    payload = sse_payload(line)
    if payload is None:
        return None
    if payload == b"[DONE]":
        return _DONE
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise EngineHTTPError(f"malformed stream chunk: {payload[:200]!r}") from None
    if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk and "text" not in chunk:
        err = chunk["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise EngineHTTPError(f"the server failed mid-stream: {message}", status=200, body=chunk)
    return chunk


def _generate_body(text: str | None, input_ids: list[int] | None, sampling_params: dict | None,
                   speculative: dict | None, stream: bool, extra: dict) -> dict:
    if (text is None) == (input_ids is None):
        raise EngineClientError("give exactly one of text or input_ids")
    body: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "stream": stream, **extra}
    if text is not None:
        body["text"] = text
    else:
        body["input_ids"] = list(input_ids)
    if speculative is not None:
        body["speculative"] = dict(speculative)
    return body


class EngineClient:
    """Blocking client. `base_url` like "http://127.0.0.1:30000"."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=10.0),
                                  transport=transport, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url + path, exc) from None

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return _json_of(self._request(method, path, **kwargs), self.base_url + path)

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _checked(response, self.base_url + path)
                for line in response.iter_lines():
                    chunk = _chunk(line)
                    if chunk is _DONE:
                        return
                    if chunk is not None:
                        yield chunk
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url + path, exc) from None

    def health(self) -> bool:
        """True when the server answers /health with 200; False when it answers otherwise or not at all."""
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def server_info(self) -> dict:
        """/server_info, falling back to SGLang's older /get_server_info."""
        try:
            return self._json("GET", "/server_info")
        except EngineBadRequest as exc:
            if exc.status != 404:
                raise
            return self._json("GET", "/get_server_info")

    def metrics_text(self) -> str:
        return _checked(self._request("GET", "/metrics"), self.base_url + "/metrics").text

    def generate(self, text: str | None = None, *, input_ids: list[int] | None = None,
                 sampling_params: dict | None = None, speculative: dict | None = None, **extra: Any) -> dict:
        """POST /generate; returns {text, output_ids, meta_info}."""
        return self._json("POST", "/generate",
                          json=_generate_body(text, input_ids, sampling_params, speculative, False, extra))

    def generate_stream(self, text: str | None = None, *, input_ids: list[int] | None = None,
                        sampling_params: dict | None = None, speculative: dict | None = None,
                        **extra: Any) -> Iterator[dict]:
        """POST /generate with stream; yields SGLang chunks (cumulative text and output_ids)."""
        return self._stream("/generate", _generate_body(text, input_ids, sampling_params, speculative, True, extra))

    def completions(self, prompt: str | list[int], *, stream: bool = False, **params: Any) -> dict | Iterator[dict]:
        """POST /v1/completions (OpenAI shape); with stream, an iterator of chunks."""
        body = {"prompt": prompt, "stream": stream, **params}
        return self._stream("/v1/completions", body) if stream else self._json("POST", "/v1/completions", json=body)

    def chat(self, messages: list[dict], *, stream: bool = False, **params: Any) -> dict | Iterator[dict]:
        """POST /v1/chat/completions (OpenAI shape); with stream, an iterator of chunks."""
        body = {"messages": messages, "stream": stream, **params}
        if stream:
            return self._stream("/v1/chat/completions", body)
        return self._json("POST", "/v1/chat/completions", json=body)


class AsyncEngineClient:
    """POST /generate for asyncio, for tests that keep many requests in flight on one pool."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, max_connections: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=10.0),
                                       limits=limits, trust_env=False)

    async def __aenter__(self) -> "AsyncEngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def generate(self, text: str | None = None, *, input_ids: list[int] | None = None,
                       sampling_params: dict | None = None, speculative: dict | None = None, **extra: Any) -> dict:
        body = _generate_body(text, input_ids, sampling_params, speculative, False, extra)
        try:
            response = await self._http.post("/generate", json=body)
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url + "/generate", exc) from None
        return _json_of(response, self.base_url + "/generate")
