"""`engine`: a long-running inference server as a job, until it is cancelled.

spec: {"kind": "builtin", "model": str | None, "draft_model": str | None, "algorithm": "ar|dflash|ddtree",
       "budget": int | None, "block_size": int | None, "device": "cpu|cuda|cuda:N", "python": str | None,
       "ready_timeout_s": float, "demo": bool}
`model` None means the demo pair (`demo` is then true). The server is started through ctx.spawn
(own process group, own log, port 0) and prints one JSON line `{"event": "listening", ...}` once it
has warmed up; the job then records an `engines` row (state running, url, port, pid) and waits.
Cancel: SIGTERM to the server's group (the runner's ctx.close does it), the row becomes `stopped`.
A server that exits on its own fails the job with the tail of its log; the row becomes `failed`.

SGLang and vLLM servers need engine/launch.py (the SGLang helper's module); until it exists such
a spec is refused at submit time with exit code 2.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import BadSpec, JobCancelled, JobError
from ddtree.store.db import transaction
from ddtree.store.queries import now

SERVER_MODULE = "ddtree.engine.reference.server"
KINDS = ("builtin", "sglang", "vllm")
ALGORITHMS = ("ar", "dflash", "ddtree")
_KEYS = {"kind", "model", "draft_model", "algorithm", "budget", "block_size", "device", "python",
         "ready_timeout_s", "demo"}
_DEVICE_RE = re.compile(r"^(cpu|cuda(:[0-9]{1,2})?)$")

#: Seconds between checks that the server is still alive while the job waits.
WATCH_S = 1.0


class EngineSpecError(BadSpec):
    """An engine job spec that cannot be started as written (exit 2)."""


class EngineStartFailed(JobError):
    """The server exited or never said where it listens."""


class EngineDied(JobError):
    """The server exited while it was serving."""


def _launch_module():
    """engine/launch.py (SGLang/vLLM launch specs) when its owner has landed it, else None."""
    try:
        from ddtree.engine import launch  # type: ignore[attr-defined]
    except ImportError:
        return None
    return launch


def _opt_int(spec: dict, key: str, minimum: int) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EngineSpecError(f"engine {key} must be an integer >= {minimum}, not {value!r}")
    return value


def _opt_str(spec: dict, key: str) -> str | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise EngineSpecError(f"engine {key} must be a non-empty string, not {value!r}")
    return value.strip()


def demo_pair() -> tuple[str, str]:
    from ddtree.jobs.plan import demo_pair as plan_demo_pair

    return plan_demo_pair()


def validate(spec: dict) -> dict:
    unknown = set(spec) - _KEYS
    if unknown:
        raise EngineSpecError(f"unknown engine option(s): {', '.join(sorted(unknown))}",
                              f"known: {', '.join(sorted(_KEYS))}")
    kind = spec.get("kind", "builtin")
    if kind not in KINDS:
        raise EngineSpecError(f"engine kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind != "builtin" and _launch_module() is None:
        raise EngineSpecError(f"starting {kind} servers is not available yet (engine/launch.py is not in this build)",
                              "use kind builtin for now")
    algorithm = spec.get("algorithm", "ddtree")
    if algorithm not in ALGORITHMS:
        raise EngineSpecError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    budget = _opt_int(spec, "budget", 0)
    if budget is not None and algorithm != "ddtree":
        raise EngineSpecError(f"a node budget applies to algorithm ddtree only, not {algorithm}")
    block_size = _opt_int(spec, "block_size", 2)
    device = spec.get("device", "cpu")
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise EngineSpecError(f"device must be cpu, cuda or cuda:N, not {device!r}")
    model, draft = _opt_str(spec, "model"), _opt_str(spec, "draft_model")
    demo = spec.get("demo", model is None)
    if not isinstance(demo, bool):
        raise EngineSpecError(f"demo must be true or false, not {demo!r}")
    if model is None:
        target_dir, drafter_dir = demo_pair()
        if not Path(target_dir).is_dir():
            raise EngineSpecError(f"the demo pair is not here ({target_dir} is missing)",
                                  "give a model folder or hub id, or train the pair with the demo script")
        model, draft, demo = target_dir, draft or drafter_dir, True
    for key, value in (("model", model), ("draft_model", draft)):
        # A local path is made absolute now: the detached runner may not share our working folder.
        if value is not None and (value.startswith((".", "/", "~")) or Path(value).exists()):
            path = Path(value).expanduser().absolute()
            if not path.is_dir():
                raise EngineSpecError(f"{key} folder not found: {path}")
            if key == "model":
                model = str(path)
            else:
                draft = str(path)
    if algorithm != "ar" and draft is None:
        raise EngineSpecError(f"algorithm {algorithm} needs a drafter (draft_model)", "or choose algorithm ar")
    python = _opt_str(spec, "python")
    timeout = spec.get("ready_timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 86400:
        raise EngineSpecError(f"ready_timeout_s must be a number of seconds from 1 to 86400, not {timeout!r}")
    return {"kind": kind, "model": model, "draft_model": draft, "algorithm": algorithm, "budget": budget,
            "block_size": block_size, "device": device, "python": python, "ready_timeout_s": float(timeout),
            "demo": demo}


def server_argv(spec: dict) -> list[str]:
    argv = [spec["python"] or sys.executable, "-m", SERVER_MODULE, "--model", spec["model"]]
    if spec["draft_model"]:
        argv += ["--draft", spec["draft_model"]]
    argv += ["--algorithm", spec["algorithm"]]
    if spec["budget"] is not None:
        argv += ["--budget", str(spec["budget"])]
    if spec["block_size"] is not None:
        argv += ["--block-size", str(spec["block_size"])]
    argv += ["--device", spec["device"], "--host", "127.0.0.1", "--port", "0"]
    return argv


class _Announcement:
    """Reads the server's log as it grows until the `listening` JSON line appears."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def poll(self) -> dict | None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return None
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if not (line.startswith("{") and "listening" in line):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "listening" and event.get("url"):
                return event
        return None


def _tail(path: Path, lines: int = 4) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return f"see {path}"
    return " | ".join(text)[-500:] or f"see {path}"


def _update_engine(ctx: JobContext, row_id: int, values: dict) -> None:
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with transaction(ctx.db):
        ctx.db.execute(f"UPDATE engines SET {sets} WHERE id = ?", [*values.values(), row_id])


def run(ctx: JobContext, spec: dict) -> dict:
    if spec["kind"] != "builtin":
        raise EngineStartFailed(f"starting {spec['kind']} servers is not wired up yet in this build")
    argv = server_argv(spec)
    with transaction(ctx.db):
        row_id = ctx.db["engines"].insert({
            "job_id": ctx.job_id, "kind": spec["kind"], "model": "demo" if spec["demo"] else spec["model"],
            "draft_model": "demo" if spec["demo"] and spec["draft_model"] else spec["draft_model"],
            "algorithm": spec["algorithm"], "budget": spec["budget"], "block_size": spec["block_size"], "tp": 1,
            "gpus": json.dumps([]), "python": argv[0], "host": "127.0.0.1", "state": "starting",
            "created_at": now(),
        }).last_pk
    proc = ctx.spawn(argv, env={"TOKENIZERS_PARALLELISM": "false"}, name="server")
    log_path = ctx.log_path.parent / f"job-{ctx.job_id}-server.log"
    _update_engine(ctx, row_id, {"pid": proc.pid, "pgid": proc.pid, "log_path": str(log_path)})
    ctx.progress(message="starting the server")
    reader = _Announcement(log_path)
    deadline = time.monotonic() + spec["ready_timeout_s"]
    event = None
    try:
        while event is None:
            event = reader.poll()
            if event is not None:
                break
            if proc.poll() is not None:
                raise EngineStartFailed(f"the server exited with code {proc.returncode} while starting",
                                        _tail(log_path))
            if time.monotonic() > deadline:
                raise EngineStartFailed(f"the server did not report a listening address within "
                                        f"{spec['ready_timeout_s']:g} s", f"see {log_path}")
            ctx.sleep(0.2)
        url = str(event["url"])
        _update_engine(ctx, row_id, {"state": "running", "base_url": url, "port": int(event["port"]),
                                     "ready_at": now()})
        ctx.log(f"server ready at {url} (pid {proc.pid})")
        ctx.progress(message=f"serving at {url}")
        while proc.poll() is None:
            ctx.sleep(WATCH_S)
        raise EngineDied(f"the server exited with code {proc.returncode}", _tail(log_path))
    except JobCancelled:
        ctx.terminate_children()
        _update_engine(ctx, row_id, {"state": "stopped", "ended_at": now()})
        raise
    except BaseException as exc:
        ctx.terminate_children()
        _update_engine(ctx, row_id, {"state": "failed", "ended_at": now(), "error": str(exc)[:500]})
        raise
