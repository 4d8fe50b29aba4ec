"""Why did the engine die? A failed engine's log tail -> one short reason for the job row.

`classify(text)` scans a log tail for the usual causes of an SGLang / vLLM / builtin server that
never became ready or died under load, and returns a `Verdict(code, reason, line)`, or None when
nothing known matches. When several causes appear (an OOM in one rank usually drags NCCL and the
scheduler down with it) the first cause in CAUSES order wins: the earlier entries are the root
causes, the later ones the usual consequences.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class Verdict:
    code: str  # stable identifier: "cuda_oom", "nccl", "port_in_use", ...
    reason: str  # short text for the job row and the console
    line: str  # the log line that decided it (trimmed)

    def describe(self) -> str:
        return f"{self.reason}: {self.line}" if self.line else self.reason

    def to_dict(self) -> dict:
        return {"code": self.code, "reason": self.reason, "line": self.line}


# (code, reason, patterns). Order matters: root causes before their consequences.
CAUSES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("unsupported_flag", "unsupported flag", (
        r"error: unrecognized arguments?:",
        r"error: argument --[\w-]+: invalid choice",
        r"error: argument --[\w-]+: invalid \w+ value",
        r"error: the following arguments are required",
        r"error: ambiguous option",
        r"Unknown speculative algorithm name",
        r"unrecognized arguments?:",
    )),
    ("import_error", "import error", (
        # Anchored: a traceback's last line starts with the exception name, while healthy logs
        # mention optional imports that failed in the middle of warning lines.
        r"^\s*ModuleNotFoundError: No module named",
        r"^\s*ImportError: ",
        r"^[\w/.-]*python[\d.]*: (?:Error while finding module specification|No module named)",
        r"^IMPORT-ERROR: ",
        r"undefined symbol: ",
        r"OSError: lib[\w.+-]+\.so[.\d]*: cannot open shared object file",
    )),
    ("missing_model", "missing model files", (
        r"Cannot find any model weights with",
        r"does not appear to have a file named",
        r"RepositoryNotFoundError",
        r"EntryNotFoundError",
        r"LocalEntryNotFoundError",
        r"GatedRepoError",
        r"is not a local folder and is not a valid model identifier",
        r"couldn't connect to 'https?://[^']+' to load",
        r"Can't load (?:the )?(?:config|tokenizer) for",
        r"No such file or directory: '[^']*(?:config\.json|\.safetensors|tokenizer[^']*)'",
        r"FileNotFoundError: .*(?:config\.json|safetensors|model)",
    )),
    ("port_in_use", "port in use", (
        r"[Aa]ddress already in use",
        r"Port is already in use",
        r"\[Errno 98\]",
        r"error while attempting to bind on address",
    )),
    ("cuda_oom", "CUDA out of memory", (
        r"CUDA out of memory",
        r"OutOfMemoryError",
        r"Not enough memory\. Please try to increase --mem-fraction-static",
        r"No available memory for the cache blocks",
        r"cudaErrorMemoryAllocation",
        r"CUBLAS_STATUS_ALLOC_FAILED",
        r"out of memory",
    )),
    ("nccl", "NCCL error", (
        r"NCCL error",
        r"ncclSystemError|ncclInternalError|ncclUnhandledCudaError|ncclInvalidUsage|ncclRemoteError",
        r"DistBackendError",
        r"NCCL WARN",
        r"ProcessGroupNCCL.*(?:[Ww]atchdog|timeout|Timeout)",
    )),
    ("no_gpu", "no usable GPU", (
        r"Found no NVIDIA driver on your system",
        r"No CUDA GPUs are available",
        r"CUDA driver version is insufficient",
        r"RuntimeError: CUDA error: invalid device ordinal",
        r"Torch not compiled with CUDA enabled",
    )),
    ("cuda_error", "CUDA error", (
        r"CUDA error: ",
        r"an illegal memory access was encountered",
        r"device-side assert triggered",
    )),
    ("bad_config", "invalid server arguments", (
        r"ValueError: --[\w-]+",
        r"(?:ValueError|AssertionError): .*(?:must be|not supported|is not supported|requires)",
    )),
    ("killed", "killed by a signal", (
        r"Killed$",
        r"SIGKILL",
        r"received signal 9",
    )),
)

_COMPILED = tuple((code, reason, tuple(re.compile(p) for p in pats)) for code, reason, pats in CAUSES)


def classify(text: str) -> Verdict | None:
    """The most telling known cause in a log text, or None."""
    if not text:
        return None
    lines = text.splitlines()
    for code, reason, patterns in _COMPILED:
        # Patterns go from specific to loose; for one pattern the last matching line is the one
        # closest to the death.
        for pattern in patterns:
            for line in reversed(lines):
                if pattern.search(line):
                    return Verdict(code, reason, _trim(line))
    return None


def classify_tail(path: str | os.PathLike | None, max_bytes: int = TAIL_BYTES) -> Verdict | None:
    """classify() over the last `max_bytes` of a log file; None when it cannot be read."""
    text = read_tail(path, max_bytes)
    return classify(text) if text else None


def read_tail(path: str | os.PathLike | None, max_bytes: int = TAIL_BYTES) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def failure_reason(path: str | os.PathLike | None, fallback: str) -> str:
    """One line for the job row: the classified cause with its line, else `fallback`."""
    verdict = classify_tail(path)
    return verdict.describe() if verdict else fallback


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _trim(line: str, width: int = 240) -> str:
    line = _ANSI.sub("", line).strip()
    return line if len(line) <= width else line[: width - 3] + "..."
