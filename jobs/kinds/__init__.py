"""Job kinds: one module per kind, `ddtree.jobs.kinds.<kind>`.

A kind module exposes
    validate(spec: dict) -> dict            normalise; raise BadSpec (exit 2) on bad input
    run(ctx: JobContext, spec: dict) -> dict | None   the return value becomes the job's result
`run` should call `ctx.check_cancelled()` (or wait on `ctx.cancelled`) in long loops and start
processes only through `ctx.spawn`.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from types import ModuleType

from ddtree.jobs.errors import BadSpec, UnknownKind

_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def available_kinds() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_kind(kind: str) -> ModuleType:
    """The module of job kind `kind`; UnknownKind if there is none."""
    if not isinstance(kind, str) or not _KIND_RE.match(kind):
        raise UnknownKind(f"bad job kind {kind!r}", f"one of {', '.join(available_kinds())}")
    name = f"{__name__}.{kind}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise UnknownKind(f"unknown job kind {kind!r}", f"one of {', '.join(available_kinds())}") from None
    if not callable(getattr(module, "validate", None)) or not callable(getattr(module, "run", None)):
        raise UnknownKind(f"job kind {kind!r} lacks validate() or run()")
    return module


def validate_spec(kind: str, spec: object) -> dict:
    """Load the kind and return its normalised spec."""
    module = load_kind(kind)
    if not isinstance(spec, dict):
        raise BadSpec(f"a {kind} job spec must be a JSON object, not {type(spec).__name__}")
    normalised = module.validate(dict(spec))
    if not isinstance(normalised, dict):
        raise BadSpec(f"{kind}.validate returned {type(normalised).__name__}, not a dict")
    return normalised
