"""`engine`: a long-running inference server as a job, until it is cancelled.

spec: {"kind": "builtin", "model": str | None, "draft_model": str | None, "algorithm": "ar|dflash|ddtree",
       "budget": int | None, "block_size": int | None, "device": "cpu|cuda|cuda:N", "python": str | None,
       "backend": "auto|fast|transformers" (builtin only), "ready_timeout_s": float, "demo": bool}
`model` None means the demo pair (`demo` is then true). The server is started through ctx.spawn
(own process group, own log, port 0) and prints one JSON line `{"event": "listening", ...}` once it
has warmed up; the job then records an `engines` row (state running, url, port, pid, and the
backend the builtin server chose, which the announcement names) and waits.
Cancel: SIGTERM to the server's group (the runner's ctx.close does it), the row becomes `stopped`.
A server that exits on its own fails the job with the tail of its log; the row becomes `failed`.

SGLang and vLLM servers (kind "sglang" | "vllm", with `python`, `gpus`, `tp`, `extra_args`, `env`)
are launched from engine/launch.py's LaunchSpec, built only from flags the interpreter's probe found,
on a free port; readiness is polled on /health, since they announce nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import BadSpec, JobCancelled, JobError
from ddtree.jobs.logfile import error_tail
from ddtree.store.db import transaction
from ddtree.store.queries import now

SERVER_MODULE = "ddtree.engine.reference.server"
KINDS = ("builtin", "sglang", "vllm")
ALGORITHMS = ("ar", "dflash", "ddtree")
BACKENDS = ("auto", "fast", "transformers")  # the builtin server's --backend
_KEYS = {"kind", "model", "draft_model", "algorithm", "budget", "block_size", "device", "python",
         "ready_timeout_s", "demo", "gpus", "tp", "extra_args", "env", "backend"}
_DEVICE_RE = re.compile(r"^(cpu|cuda(:[0-9]{1,2})?)$")

#: Seconds between checks that the server is still alive while the job waits.
WATCH_S = 1.0


class EngineSpecError(BadSpec):
    """An engine job spec that cannot be started as written (exit 2)."""


class EngineStartFailed(JobError):
    """The server exited or never said where it listens."""


class EngineDied(JobError):
    """The server exited while it was serving."""


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
    if kind != "builtin" and (not spec.get("model") or not spec.get("python")):
        raise EngineSpecError(f"a {kind} engine needs model and python (the interpreter that has {kind})")
    gpus = spec.get("gpus", [0] if kind != "builtin" else [])
    if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise EngineSpecError(f"gpus must be a list of GPU indices, not {gpus!r}")
    tp = _opt_int(spec, "tp", 1) or max(len(gpus), 1)
    extra_args, env = spec.get("extra_args", []), spec.get("env", {})
    if not isinstance(extra_args, list) or not all(isinstance(a, str) for a in extra_args):
        raise EngineSpecError(f"extra_args must be a list of strings, not {extra_args!r}")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise EngineSpecError(f"env must map names to strings, not {env!r}")
    algorithm = spec.get("algorithm", "ddtree")
    if algorithm not in ALGORITHMS:
        raise EngineSpecError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    budget = _opt_int(spec, "budget", 0)
    if budget is not None and algorithm != "ddtree":
        raise EngineSpecError(f"a node budget applies to algorithm ddtree only, not {algorithm}")
    block_size = _opt_int(spec, "block_size", 2)
    backend = spec.get("backend", "auto")
    if backend not in BACKENDS:
        raise EngineSpecError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if kind != "builtin" and backend != "auto":
        raise EngineSpecError(f"backend applies to the builtin engine only, not {kind}", "leave it out")
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
    if python is not None and shutil.which(python) is None:
        raise EngineSpecError(f"python interpreter not found or not executable: {python}",
                              f"the path of the python that has {kind} installed")
    timeout = spec.get("ready_timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 86400:
        raise EngineSpecError(f"ready_timeout_s must be a number of seconds from 1 to 86400, not {timeout!r}")
    return {"kind": kind, "model": model, "draft_model": draft, "algorithm": algorithm, "budget": budget,
            "block_size": block_size, "device": device, "python": python, "ready_timeout_s": float(timeout),
            "demo": demo, "gpus": gpus, "tp": tp, "extra_args": extra_args, "env": env, "backend": backend}


def server_argv(spec: dict) -> list[str]:
    argv = [spec["python"] or sys.executable, "-m", SERVER_MODULE, "--model", spec["model"]]
    if spec["draft_model"]:
        argv += ["--draft", spec["draft_model"]]
    argv += ["--algorithm", spec["algorithm"]]
    if spec["budget"] is not None:
        argv += ["--budget", str(spec["budget"])]
    if spec["block_size"] is not None:
        argv += ["--block-size", str(spec["block_size"])]
    argv += ["--device", spec["device"], "--backend", spec.get("backend") or "auto",
             "--host", "127.0.0.1", "--port", "0"]
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
        text = path.read_text(errors="replace")
    except OSError:
        return f"see {path}"
    return error_tail(text, lines, 500) or f"see {path}"


def _update_engine(ctx: JobContext, row_id: int, values: dict) -> None:
    sets = ", ".join(f"[{k}] = ?" for k in values)
    with transaction(ctx.db):
        ctx.db.execute(f"UPDATE engines SET {sets} WHERE id = ?", [*values.values(), row_id])


def _launch(ctx: JobContext, spec: dict):
    """An SGLang/vLLM LaunchSpec for this job (probing the interpreter once, cached in the data dir)."""
    from ddtree.engine.errors import EngineError
    from ddtree.engine.launch import build_launch, free_port

    table = {key: spec.get(key) for key in ("kind", "python", "model", "draft_model", "block_size", "device",
                                            "extra_args", "env")}
    table["numa_bind"] = "off"
    try:
        return build_launch(table, algorithm=spec["algorithm"], budget=spec["budget"], tp=spec["tp"],
                            gpus=spec["gpus"], port=free_port(), cache_dir=ctx.data_dir)
    except EngineError as exc:
        raise EngineStartFailed(f"cannot launch this {spec['kind']} server: {exc}") from None


def _wait_health(ctx: JobContext, launch, proc, timeout_s: float, log_path: Path) -> dict:
    """SGLang/vLLM announce nothing: poll /health until it answers, the server dies, or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            from ddtree.engine.logclass import failure_reason

            raise EngineStartFailed(failure_reason(log_path, f"the server exited with code {proc.returncode}"))
        try:
            if httpx.get(launch.health_url, timeout=2.0).status_code == 200:
                return {"url": launch.base_url, "port": launch.port}
        except httpx.HTTPError:
            pass
        ctx.sleep(0.5)
    raise EngineStartFailed(f"the server did not answer /health within {timeout_s:g} s", f"see {log_path}")


def run(ctx: JobContext, spec: dict) -> dict:
    launch = _launch(ctx, spec) if spec["kind"] != "builtin" else None
    argv = list(launch.argv) if launch else server_argv(spec)
    with transaction(ctx.db):
        row_id = ctx.db["engines"].insert({
            "job_id": ctx.job_id, "kind": spec["kind"], "model": "demo" if spec["demo"] else spec["model"],
            "draft_model": "demo" if spec["demo"] and spec["draft_model"] else spec["draft_model"],
            "algorithm": spec["algorithm"], "budget": spec["budget"], "block_size": spec["block_size"], "tp": 1,
            "gpus": json.dumps(spec.get("gpus") or []), "python": argv[0], "host": "127.0.0.1", "state": "starting",
            "created_at": now(),
        }).last_pk
    env = launch.spawn_env() if launch else {"TOKENIZERS_PARALLELISM": "false"}
    proc = ctx.spawn(argv, env=env, name="server")
    log_path = ctx.child_log(proc)  # made for this launch: no older server's listening line in it
    _update_engine(ctx, row_id, {"pid": proc.pid, "pgid": proc.pid, "log_path": str(log_path)})
    ctx.progress(message="starting the server")
    reader = _Announcement(log_path)
    deadline = time.monotonic() + spec["ready_timeout_s"]
    event = None
    try:
        if launch is not None:
            event = _wait_health(ctx, launch, proc, spec["ready_timeout_s"], log_path)
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
        ready = {"state": "running", "base_url": url, "port": int(event["port"]), "ready_at": now()}
        if isinstance(event.get("backend"), str):
            ready["backend"] = event["backend"]  # what auto chose; sglang/vllm have none
        _update_engine(ctx, row_id, ready)
        backend = f", backend {ready['backend']}" if "backend" in ready else ""
        ctx.log(f"server ready at {url} (pid {proc.pid}{backend})")
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
