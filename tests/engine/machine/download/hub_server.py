"""A small local Hugging Face Hub for tests and benchmarks (loopback only, a free port).

It speaks what huggingface_hub 1.33 and 2.4 call when downloading:
  GET  /api/{type}s/{repo}[/revision/{rev}]      repo info: id, sha, private, gated, siblings
  GET  /api/{type}s/{repo}/tree/{rev}[/{path}]   file listing with sizes (+ lfs), paginated by Link
  HEAD /{repo}/resolve/{rev}/{path}              X-Repo-Commit, ETag, Content-Length, Accept-Ranges
  GET  /{repo}/resolve/{rev}/{path}              the bytes; Range requests answer 206
(dataset/space files live under /datasets/ and /spaces/). Errors carry the X-Error-Code headers the
client maps to its exceptions: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo.

A gated repo answers 401 without a token and 403 with a token not on its list. `rate_bps` throttles
every response body (to test cancel mid-download); `requests` records what was asked, including
whether an Authorization header came (never its value).

Run standalone: `python tests/engine/machine/download/hub_server.py --repo org/name=DIR ...` prints
{"url": ...} once listening.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_MIN_SIZE = 1024  # bigger files are served as LFS objects (sha256 etag), as the real hub does


@dataclass
class RepoData:
    files: dict[str, bytes | Path]
    sha: str = ""
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    gated: bool = False
    allowed_tokens: tuple[str, ...] = ()
    repo_type: str = "model"
    _meta: dict[str, tuple[int, str, str | None]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for path in sorted(self.files):
            size, oid, sha256 = self._describe(path)
            self._meta[path] = (size, oid, sha256)
            digest.update(f"{path}\0{oid}\n".encode())
        if not self.sha:
            self.sha = digest.hexdigest()
        self.refs.setdefault("main", self.sha)

    def _describe(self, path: str) -> tuple[int, str, str | None]:
        data = self.files[path]
        if isinstance(data, Path):
            size = data.stat().st_size
            # big generated files: derive ids from name and size instead of hashing gigabytes
            oid = hashlib.sha1(f"{data}:{size}".encode()).hexdigest()
            return size, oid, hashlib.sha256(f"{data}:{size}".encode()).hexdigest()
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        sha256 = hashlib.sha256(data).hexdigest() if len(data) >= LFS_MIN_SIZE else None
        return len(data), oid, sha256

    def etag(self, path: str) -> str:
        size, oid, sha256 = self._meta[path]
        return sha256 or oid

    def size(self, path: str) -> int:
        return self._meta[path][0]

    def tree_entry(self, path: str) -> dict:
        size, oid, sha256 = self._meta[path]
        entry = {"type": "file", "oid": oid, "size": size, "path": path}
        if sha256:
            entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
        return entry

    def read(self, path: str, start: int, end: int) -> bytes:
        data = self.files[path]
        if isinstance(data, Path):
            with open(data, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        return data[start:end]


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorized: bool  # an Authorization header was sent


class Hub:
    def __init__(self, repos: dict[str, RepoData] | None = None, *, rate_bps: float | None = None,
                 page_size: int = 1000) -> None:
        self.repos = dict(repos or {})
        self.rate_bps = rate_bps
        self.page_size = page_size
        self.requests: list[Request] = []
        self.failing: set[str] = set()  # file paths that answer 500 (to test failures)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Hub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Hub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def gets(self, filename: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename) and "/resolve/" in r.path]


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)) if "Content-Length" not in (headers or {}) else headers["Content-Length"])
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, *, head: bool = False) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
                   head=head)

    def _authorized(self, repo: RepoData) -> int:
        """200 if allowed, else the status to answer (401 no token, 403 token without access)."""
        if not repo.gated:
            return 200
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return 401
        return 200 if auth[len("Bearer "):] in repo.allowed_tokens else 403

    def _find_repo(self, parts: list[str], head: bool) -> tuple[RepoData | None, list[str]]:
        if len(parts) < 2:
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None, parts
        repo_id = f"{parts[0]}/{parts[1]}"
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None, parts
        return repo, parts[2:]

    def _commit(self, repo: RepoData, rev: str, head: bool) -> str | None:
        rev = unquote(rev)
        if rev == repo.sha or rev in repo.refs:
            return repo.refs.get(rev, repo.sha)
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        return None

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    def _route(self, head: bool) -> None:
        url = urlsplit(self.path)
        self.hub.requests.append(Request(self.command, url.path, self.headers.get("Range"),
                                         "Authorization" in self.headers))
        parts = [p for p in url.path.split("/") if p]
        query = parse_qs(url.query)
        if parts[:1] == ["api"] and len(parts) >= 2 and parts[1] in ("models", "datasets", "spaces"):
            repo, rest = self._find_repo(parts[2:], head)
            if repo is None:
                return
            if not rest:
                return self._info(repo, "main", head)
            if rest[0] == "revision" and len(rest) >= 2:
                return self._info(repo, "/".join(rest[1:]), head)
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1], "/".join(rest[2:]), query, head)
            return self._error(404, "EntryNotFound", "Unknown API route", head=head)
        if parts[:1] in (["datasets"], ["spaces"]):
            parts = parts[1:]
        repo, rest = self._find_repo(parts, head)
        if repo is None:
            return
        if len(rest) >= 3 and rest[0] == "resolve":
            return self._resolve(repo, rest[1], "/".join(unquote(p) for p in rest[2:]), head)
        self._error(404, "EntryNotFound", "Unknown route", head=head)

    def _info(self, repo: RepoData, rev: str, head: bool) -> None:
        commit = self._commit(repo, rev, head)
        if commit is None:
            return
        repo_id = next(k for k, v in self.hub.repos.items() if v is repo)
        body = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False,
                "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=head)

    def _tree(self, repo: RepoData, rev: str, prefix: str, query: dict, head: bool) -> None:
        if self._commit(repo, rev, head) is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = unquote(prefix).strip("/")
        entries: list[dict] = []
        folders: set[str] = set()
        for path in sorted(repo.files):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rel = path[len(prefix) + 1:] if prefix else path
            if not recursive and "/" in rel:
                folders.add((prefix + "/" if prefix else "") + rel.split("/")[0])
                continue
            if recursive:
                dirs = path.split("/")[:-1]
                for i in range(len(dirs)):
                    folders.add("/".join(dirs[: i + 1]))
            entries.append(repo.tree_entry(path))
        entries = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)] + entries
        cursor = int(query.get("cursor", ["0"])[0])
        page = entries[cursor: cursor + self.hub.page_size]
        headers = {"Content-Type": "application/json"}
        if cursor + self.hub.page_size < len(entries):
            host, port = self.server.server_address[:2]
            nxt = (f"http://{host}:{port}{urlsplit(self.path).path}?recursive={str(recursive).lower()}"
                   f"&cursor={cursor + self.hub.page_size}")
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send(200, json.dumps(page).encode(), headers, head=head)

    def _resolve(self, repo: RepoData, rev: str, path: str, head: bool) -> None:
        commit = self._commit(repo, rev, head)
        if commit is None:
            return
        status = self._authorized(repo)
        if status != 200:
            return self._error(status, "GatedRepo", "Access to model is restricted", head=head)
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", head=head)
        if path in self.hub.failing:
            return self._error(500, "", "Internal Error", head=head)
        size = repo.size(path)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{repo.etag(path)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            lo, _, hi = rng[len("bytes="):].partition("-")
            start = int(lo or 0)
            end = min(size, int(hi) + 1) if hi else size
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        headers["Content-Length"] = str(end - start)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        self._stream(repo, path, start, end)

    def _stream(self, repo: RepoData, path: str, start: int, end: int) -> None:
        block = 1 << 20
        rate = self.hub.rate_bps
        if rate:
            block = max(4096, min(block, int(rate / 20)))
        t0 = time.monotonic()
        sent = 0
        try:
            pos = start
            while pos < end:
                chunk = repo.read(path, pos, min(end, pos + block))
                self.wfile.write(chunk)
                pos += len(chunk)
                sent += len(chunk)
                if rate:
                    ahead = sent / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def repo_from_dir(folder: Path, **kwargs) -> RepoData:
    files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return RepoData(files=files, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", default=[], help="ORG/NAME=DIR (files served from DIR)")
    parser.add_argument("--rate-bps", type=float, default=None)
    args = parser.parse_args(argv)
    repos = {}
    for item in args.repo:
        repo_id, _, folder = item.partition("=")
        repos[repo_id] = repo_from_dir(Path(folder))
    hub = Hub(repos, rate_bps=args.rate_bps).start()
    print(json.dumps({"event": "listening", "url": hub.url}), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

