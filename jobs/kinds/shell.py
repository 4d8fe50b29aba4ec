"""`shell`: runs one command as a child process (own group, own log file).

spec: {"command": str (run by /bin/sh -c) | "argv": [str, ...], "cwd": str, "env": {str: str},
       "check": bool (a non-zero exit fails the job; default true)}
"""

from __future__ import annotations

import os

from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import BadSpec, JobError

_KEYS = {"command", "argv", "cwd", "env", "check"}


def validate(spec: dict) -> dict:
    unknown = set(spec) - _KEYS
    if unknown:
        raise BadSpec(f"unknown shell option(s): {', '.join(sorted(unknown))}", f"known: {', '.join(sorted(_KEYS))}")
    command, argv = spec.get("command"), spec.get("argv")
    if (command is None) == (argv is None):
        raise BadSpec("a shell job needs exactly one of command or argv")
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise BadSpec("shell command must be a non-empty string")
        argv = ["/bin/sh", "-c", command]
    elif not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise BadSpec("shell argv must be a non-empty list of strings")
    cwd = spec.get("cwd")
    if cwd is not None:
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadSpec(f"shell cwd {cwd!r} is not a folder")
        cwd = os.path.abspath(cwd)
    env = spec.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadSpec("shell env must map strings to strings")
    check = spec.get("check", True)
    if not isinstance(check, bool):
        raise BadSpec(f"shell check must be true or false, not {check!r}")
    return {"argv": argv, "cwd": cwd, "env": env, "check": check}


def run(ctx: JobContext, spec: dict) -> dict:
    proc = ctx.spawn(spec["argv"], env=spec["env"] or None, cwd=spec["cwd"], name="shell")
    ctx.progress(message=f"pid {proc.pid}")
    while proc.poll() is None:
        if ctx.cancelled.wait(0.1):
            # The runner stops the child's group; wait for that instead of leaving it behind.
            proc.wait()
            ctx.check_cancelled()
    ctx.log(f"command exited with {proc.returncode}")
    if spec["check"] and proc.returncode != 0:
        raise JobError(f"command exited with status {proc.returncode}", f"see its log in {ctx.log_path.parent}")
    return {"returncode": proc.returncode}
