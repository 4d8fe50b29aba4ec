"""Errors of the builtin engine (all are `ddtree.engine.errors.EngineError`).

    EngineError
    ├── BadParams         invalid generation/speculation parameters (exit code 2)
    ├── ModelLoadError    a model or drafter directory is missing, malformed or mismatched (2)
    └── DecodeError       a failure while decoding (1)
"""

from __future__ import annotations

from ddtree.engine.errors import EngineError


class BadParams(EngineError):
    exit_code = 2


class ModelLoadError(EngineError):
    exit_code = 2


class DecodeError(EngineError):
    exit_code = 1
