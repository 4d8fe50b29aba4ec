"""`sleep`: waits, reporting progress; for tests and for trying the supervisor.

spec: {"seconds": float >= 0, "fail": bool (raise at the end), "message": str}
"""

from __future__ import annotations

import time

from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import BadSpec

_KEYS = {"seconds", "fail", "message"}


def validate(spec: dict) -> dict:
    unknown = set(spec) - _KEYS
    if unknown:
        raise BadSpec(f"unknown sleep option(s): {', '.join(sorted(unknown))}", f"known: {', '.join(sorted(_KEYS))}")
    seconds = spec.get("seconds", 1.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 7 * 86400:
        raise BadSpec(f"sleep seconds must be a number from 0 to 604800, not {seconds!r}")
    fail = spec.get("fail", False)
    if not isinstance(fail, bool):
        raise BadSpec(f"sleep fail must be true or false, not {fail!r}")
    return {"seconds": float(seconds), "fail": fail, "message": str(spec.get("message", ""))}


def run(ctx: JobContext, spec: dict) -> dict:
    seconds = spec["seconds"]
    start = time.monotonic()
    ctx.log(f"sleeping {seconds:g} s")
    while True:
        elapsed = time.monotonic() - start
        ctx.progress(min(elapsed, seconds), seconds, spec["message"] or None)
        if elapsed >= seconds:
            break
        ctx.sleep(min(0.1, seconds - elapsed))
    if spec["fail"]:
        raise RuntimeError(spec["message"] or "asked to fail")
    return {"slept_s": round(time.monotonic() - start, 3)}
