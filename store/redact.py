"""Secrets in recipes and job specs: the one redaction every shown or stored copy goes through.

An `env` table (a recipe's `engine.env`, an engine job's `env`) may carry credentials, e.g.
`HF_TOKEN`. Values of secret-looking names (TOKEN, KEY, SECRET, PASSWORD anywhere in the name, any
case) are replaced by `REDACTED` in what is stored (runs.recipe, jobs.spec), printed (dry runs,
exports, `runs --json`) and logged (launch lines). The real values travel only in process
environments: the CLI hands them to the runner's environment (`secret_env`), and the runner, when it
starts an engine, leaves a `REDACTED` value out so the engine inherits the real one from it.
A resume has no recipe value to give: the secret then comes from the environment it runs in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: What a secret's value reads as wherever it is shown or stored.
REDACTED = "<redacted>"

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """True for an environment variable name that looks like it holds a credential."""
    return bool(_SECRET_NAME.search(str(name)))


def redact_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """`env` with the values of secret-looking names replaced by REDACTED (a new dict)."""
    return {k: (REDACTED if is_secret(k) and v is not None else v) for k, v in env.items()}


def redact(value: Any) -> Any:
    """A copy of a JSON-like document with every `env` table in it redacted (at any depth: a
    sweep spec holds its recipe, a recipe its engine table). Other values are kept as they are."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if k == "env" and isinstance(v, Mapping):
                out[k] = redact_env(v)
            elif k == "env" and isinstance(v, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                                     for p in v):
                out[k] = type(v)((name, REDACTED if is_secret(name) else val) for name, val in v)  # (name, value) pairs
            else:
                out[k] = redact(v)
        return out
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def secret_env(value: Any) -> dict[str, str]:
    """The real values `redact` would hide, by name: what the runner's environment must carry."""
    found: dict[str, str] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            pairs = None
            if k == "env" and isinstance(v, Mapping):
                pairs = v.items()
            elif k == "env" and isinstance(v, (list, tuple)):
                pairs = [p for p in v if isinstance(p, (list, tuple)) and len(p) == 2]
            if pairs is not None:
                found.update({str(n): str(s) for n, s in pairs
                              if is_secret(n) and isinstance(s, str) and s != REDACTED})
            else:
                found.update(secret_env(v))
    elif isinstance(value, list):
        for v in value:
            found.update(secret_env(v))
    return found
