"""`engine`: a long-running inference server as a job, until it is cancelled.

spec: {"kind": "builtin", "model": str | None, "draft_model": str | None, "algorithm": "ar|dflash|ddtree",
       "budget": int | None, "block_size": int | None, "device": "cpu|cuda|cuda:N", "python": str | None,
       "backend": "auto|fast|transformers" (builtin only), "ready_timeout_s": float, "demo": bool}
The spec is the `[engine]` table of a recipe (jobs/recipe.EngineSpec, the one engine schema) less
a sweep's settings (numa_bind, api, draft_window), plus `tp` and `demo`. `model` None means the
demo pair (`demo` is then true). The server runs as jobs/engine_process.EngineProcess: started
through ctx.spawn (own process group, own log, port 0 for builtin), it prints one JSON line
`{"event": "listening", ...}` once it has warmed up; its `engines` row then reads running (url,
port, pid, and the backend the builtin server chose, which the announcement names) and the job waits.
Cancel: SIGTERM to the server's group (EngineProcess.stop), the row becomes `stopped`.
A server that exits on its own fails the job with the tail of its log; the row becomes `failed`.

SGLang and vLLM servers (kind "sglang" | "vllm", with `python`, `gpus`, `tp`, `extra_args`, `env`)
are launched from engine/serving/launch.py's LaunchSpec, built only from flags the interpreter's
probe found, on a free port; readiness is polled on /health, since they announce nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ddtree.engine.serving.launch import LaunchSpec, builtin_argv
from ddtree.jobs.context import JobContext
from ddtree.jobs.engine_process import EngineProcess, EngineStartFailed, log_tail
from ddtree.jobs.errors import JobCancelled, JobError
from ddtree.jobs.recipe import EngineSpec, RecipeError, engine_from_dict

#: Settings of a recipe's [engine] that only a sweep uses (NUMA pinning, the client's API, SGLang's draft window).
SWEEP_ONLY = ("numa_bind", "api", "draft_window")
#: The job's own keys on top of the [engine] table.
JOB_KEYS = ("tp", "demo")
TABLE_KEYS = tuple(k for k in EngineSpec.__dataclass_fields__ if k not in SWEEP_ONLY)
MAX_READY_TIMEOUT_S = 86400

#: Seconds between checks that the server is still alive while the job waits.
WATCH_S = 1.0


class EngineDied(JobError):
    """The server exited while it was serving."""


def demo_pair() -> tuple[str, str]:
    from ddtree.jobs.plan import demo_pair as plan_demo_pair

    return plan_demo_pair()


def _stripped(spec: dict) -> dict:
    return {k: v.strip() if isinstance(v, str) and k in ("python", "model", "draft_model") else v
            for k, v in spec.items()}


def validate(spec: dict) -> dict:
    """The job spec, checked through recipe.EngineSpec and normalised (local paths made absolute,
    the demo pair filled in); raises RecipeError (one line, exit 2)."""
    if not isinstance(spec, dict):
        raise RecipeError("an engine spec must be a table")
    spec = _stripped(spec)
    kind = spec.get("kind", "builtin")
    if kind in ("sglang", "vllm") and (not spec.get("model") or not spec.get("python")):
        raise RecipeError(f"a {kind} engine needs model and python (the interpreter that has {kind})")
    # None is "not given": a normalised spec, which the store holds, has them and reads back the same.
    table = {k: v for k, v in spec.items() if k not in JOB_KEYS and v is not None}
    if kind in ("sglang", "vllm"):
        table.setdefault("gpus", [0])
    engine = engine_from_dict(table, allowed=TABLE_KEYS + JOB_KEYS)  # both named in an unknown key's hint
    tp = spec.get("tp")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise RecipeError(f"engine.tp must be an integer >= 1, got {tp!r}")
    if engine.budget is not None and engine.algorithm != "ddtree":
        raise RecipeError(f"a node budget applies to algorithm ddtree only, not {engine.algorithm}")
    if engine.ready_timeout_s > MAX_READY_TIMEOUT_S:
        raise RecipeError(f"engine.ready_timeout_s must be <= {MAX_READY_TIMEOUT_S}, got {engine.ready_timeout_s:g}")
    model, draft = engine.model, engine.draft_model
    demo = spec.get("demo", model is None)
    if not isinstance(demo, bool):
        raise RecipeError(f"demo must be true or false, not {demo!r}")
    if model is None:
        target_dir, drafter_dir = demo_pair()
        if not Path(target_dir).is_dir():
            raise RecipeError(f"the demo pair is not here ({target_dir} is missing)",
                              "give a model folder or hub id, or train the pair with the demo script")
        model, draft, demo = target_dir, draft or drafter_dir, True
    model, draft = _local("model", model), _local("draft_model", draft)
    if engine.algorithm != "ar" and draft is None:
        raise RecipeError(f"algorithm {engine.algorithm} needs a drafter (draft_model)", "or choose algorithm ar")
    if engine.python is not None and shutil.which(engine.python) is None:
        raise RecipeError(f"python interpreter not found or not executable: {engine.python}",
                          f"the path of the python that has {kind} installed")
    return {"kind": engine.kind, "model": model, "draft_model": draft, "algorithm": engine.algorithm,
            "budget": engine.budget, "block_size": engine.block_size, "device": engine.device,
            "python": engine.python, "ready_timeout_s": engine.ready_timeout_s, "demo": demo,
            "gpus": list(engine.gpus), "tp": tp or max(len(engine.gpus), 1), "extra_args": list(engine.extra_args),
            "env": dict(engine.env), "backend": engine.backend}


def _local(key: str, value: str | None) -> str | None:
    """A local path made absolute now (the detached runner may not share our working folder); a hub id as is."""
    if value is None or not (value.startswith((".", "/", "~")) or Path(value).exists()):
        return value
    path = Path(value).expanduser().absolute()
    if not path.is_dir():
        raise RecipeError(f"{key} folder not found: {path}")
    return str(path)


def server_argv(spec: dict) -> list[str]:
    """The builtin server's command line for a validated spec (port 0: it announces the one it takes).
    On the demo pair --model (and --draft, when it is the demo drafter) is left out: the server
    loads the pair itself and serves it as demo/target, and neither the job's log nor its command
    line shows the pair's install path."""
    model, draft = spec["model"], spec["draft_model"]
    if spec["demo"]:
        target, drafter = demo_pair()
        if model == target:
            model = None
            draft = None if draft == drafter else draft
    return builtin_argv(python=spec["python"], model=model, draft=draft,
                        algorithm=spec["algorithm"], budget=spec["budget"], block_size=spec["block_size"],
                        device=spec["device"], backend=spec.get("backend"))


def _launch(ctx: JobContext, spec: dict) -> LaunchSpec:
    """This job's LaunchSpec: the builtin server on port 0, or an SGLang/vLLM server built from
    the flags its interpreter accepts (probed once, cached in the data dir) on a free port."""
    if spec["kind"] == "builtin":
        return LaunchSpec(kind="builtin", argv=tuple(server_argv(spec)), env={"TOKENIZERS_PARALLELISM": "false"},
                          port=0, announces_url=True, algorithm=spec["algorithm"], budget=spec["budget"])
    from ddtree.engine.errors import EngineError
    from ddtree.engine.serving.launch import build_launch, free_port

    table = {key: spec.get(key) for key in ("kind", "python", "model", "draft_model", "block_size", "device",
                                            "extra_args", "env")}
    table["numa_bind"] = "off"
    try:
        return build_launch(table, algorithm=spec["algorithm"], budget=spec["budget"], tp=spec["tp"],
                            gpus=spec["gpus"], port=free_port(), cache_dir=ctx.data_dir)
    except EngineError as exc:
        raise EngineStartFailed(f"cannot launch this {spec['kind']} server: {exc}") from None


def run(ctx: JobContext, spec: dict) -> dict:
    launch = _launch(ctx, spec)
    row = {"job_id": ctx.job_id, "kind": spec["kind"], "model": "demo" if spec["demo"] else spec["model"],
           "draft_model": "demo" if spec["demo"] and spec["draft_model"] else spec["draft_model"],
           "algorithm": spec["algorithm"], "budget": spec["budget"], "block_size": spec["block_size"], "tp": 1,
           "gpus": json.dumps(spec.get("gpus") or []), "python": launch.argv[0], "host": "127.0.0.1"}
    server = EngineProcess(ctx, launch, name="server", ready_timeout_s=spec["ready_timeout_s"], row=row)
    try:
        server.start()
        ctx.progress(message="starting the server")
        # The builtin server announces once it has warmed up and bound its port: that is ready.
        url = server.wait_ready(health=False)
        backend = f", backend {server.backend}" if server.backend else ""
        ctx.log(f"server ready at {url} (pid {server.proc.pid}{backend})")
        ctx.progress(message=f"serving at {url}")
        while server.exited() is None:
            ctx.sleep(WATCH_S)
        raise EngineDied(f"the server exited with code {server.proc.returncode}", log_tail(server.log_path, 4))
    except JobCancelled:
        server.stop("stopped")
        raise
    except BaseException as exc:
        server.stop("failed", str(exc)[:500])
        raise
