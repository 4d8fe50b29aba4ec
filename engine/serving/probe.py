"""What an installed SGLang or vLLM can do, asked of its own interpreter.

SGLang usually lives in a venv of its own, so nothing here imports it: `probe(kind, python)` runs
`<python> -m sglang.launch_server --help` (vLLM: `<python> -m vllm.entrypoints.cli.main serve
--help=all`) once, with a timeout, in its own process group, and reads from the help text the
flag names that exist and the speculative algorithms the build accepts. The version comes from
the interpreter's package metadata. Results are cached on disk (`cache_dir/engine-probes.json`)
keyed by engine kind, interpreter path and its mtime, and checked against the installed version on
every use, so upgrading SGLang inside the same venv re-probes.

Launch builders (engine/serving/sglang.py, engine/serving/vllm.py) then build commands only from flags that exist,
and refuse with the errors below instead of launching something that dies.

Errors (all EngineError):
    LaunchConfigError (exit 2)      the recipe asks for something that cannot be launched as written
        UnsupportedAlgorithmError   the engine build lacks the algorithm (e.g. no DDTREE in SGLang 0.5.23)
        UnsupportedFlagError        a flag (extra_args, or one we need) is not in this build
    ProbeError (exit 1)             the interpreter could not answer (not installed, crashed, timed out)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.engine.errors import EngineError

PROBE_TIMEOUT_S = 240.0
VERSION_TIMEOUT_S = 60.0
CACHE_FILE = "engine-probes.json"
CACHE_FORMAT = 1
KINDS = ("sglang", "vllm")

# Run by the engine's interpreter: metadata first (no import: importing sglang pulls in torch).
_VERSION_SCRIPT = """
import sys
name = sys.argv[1]
try:
    from importlib.metadata import version, PackageNotFoundError
    try:
        print(version(name))
        raise SystemExit(0)
    except PackageNotFoundError:
        pass
    mod = __import__(name)
    print(getattr(mod, "__version__", "unknown"))
except ImportError as exc:
    print("IMPORT-ERROR: %s" % exc, file=sys.stderr)
    raise SystemExit(3)
"""

# vLLM's accepted `method` values live in a typing.Literal in its config module; reading the source
# text finds them without importing vllm (which needs CUDA libraries to import at all).
_VLLM_METHODS_SCRIPT = """
import importlib.util, json, os, re, sys
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    print("IMPORT-ERROR: No module named 'vllm'", file=sys.stderr)
    raise SystemExit(3)
root = list(spec.submodule_search_locations)[0]
names = set()
for rel in ("config/speculative.py", "config.py"):
    path = os.path.join(root, rel)
    if os.path.exists(path):
        text = open(path, encoding="utf-8", errors="replace").read()
        for block in re.findall(r"(?:SpeculativeMethod|\\w*ModelTypes)\\s*=\\s*Literal\\[(.*?)\\]", text, re.S):
            names.update(re.findall(r'"([a-z0-9_]+)"', block))
print(json.dumps(sorted(names)))
"""


class LaunchConfigError(EngineError):
    """The recipe asks for a launch that cannot work as written (bad input)."""

    exit_code = 2


class UnsupportedAlgorithmError(LaunchConfigError):
    """The installed engine build does not have the requested speculative algorithm."""


class UnsupportedFlagError(LaunchConfigError):
    """A flag is not accepted by the installed engine build."""


class ProbeError(EngineError):
    """The engine's interpreter could not tell what it supports."""


@dataclass(frozen=True)
class Capabilities:
    """What one engine build accepts. `algorithms` are SGLang names (upper case) or vLLM methods."""

    kind: str
    python: str
    version: str | None
    flags: frozenset[str]
    algorithms: frozenset[str]
    probed_at: float = 0.0
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LaunchConfigError(f"unknown engine kind {self.kind!r}", "use one of: " + ", ".join(KINDS))
        object.__setattr__(self, "flags", frozenset(self.flags))
        object.__setattr__(self, "algorithms", frozenset(self.algorithms))

    @property
    def label(self) -> str:
        name = "SGLang" if self.kind == "sglang" else "vLLM"
        return f"{name} {self.version}" if self.version else name

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def first(self, *names: str) -> str | None:
        """The first of `names` this build accepts (flags get renamed across releases)."""
        return next((n for n in names if n in self.flags), None)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "python": self.python, "version": self.version,
                "flags": sorted(self.flags), "algorithms": sorted(self.algorithms),
                "probed_at": self.probed_at, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> Capabilities:
        return cls(kind=data["kind"], python=data["python"], version=data.get("version"),
                   flags=frozenset(data.get("flags", ())), algorithms=frozenset(data.get("algorithms", ())),
                   probed_at=float(data.get("probed_at", 0.0)), notes=tuple(data.get("notes", ())))


# -- help text parsing ---------------------------------------------------------------------------

_OPTION_LINE = re.compile(r"^ {1,6}(-{1,2}[A-Za-z0-9][\w.-]*)")
_USAGE_FLAG = re.compile(r"\[(--[A-Za-z0-9][\w.-]*)")
_CHOICES = re.compile(r"--speculative-algorithm\s+\{([^}]*)\}")
_BUILTINS = re.compile(r"Builtins?:\s*([A-Z0-9_,\s]+?)(?:\.|\s+Or\b|$)", re.S)


def parse_help_flags(text: str) -> frozenset[str]:
    """Every option name in an argparse help text, aliases included
    (`--tp-size TP_SIZE, --tensor-parallel-size TP_SIZE`), and the `[--a | --no-a]` pairs of usage."""
    flags: set[str] = set()
    for line in text.splitlines():
        if not _OPTION_LINE.match(line):
            continue  # help prose is indented deeper (24 columns) and may mention flags in passing
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for part in head.split(", "):
            name = part.split(" ", 1)[0].split("=", 1)[0]
            if name.startswith("-"):
                flags.add(name)
    for m in _USAGE_FLAG.finditer(text):
        flags.add(m.group(1))
    flags.update(m.group(1) for m in re.finditer(r"\|\s+(--[A-Za-z0-9][\w.-]*)\]", text))
    return frozenset(f for f in flags if len(f) > 2)


def parse_sglang_algorithms(text: str, flags: frozenset[str]) -> frozenset[str]:
    """Speculative algorithms a SGLang help text admits: argparse choices (older releases,
    `{DFLASH,EAGLE,...}`) or the "Builtins: ..." list of the free-text flag (0.5.2x). A build
    with the DDTree budget flag has DDTREE even when a plugin registered it without saying so."""
    algos: set[str] = set()
    m = _CHOICES.search(text)
    if m:
        algos.update(a.strip().upper() for a in m.group(1).split(",") if a.strip())
    # The help of --speculative-algorithm follows its option line; argparse wraps it.
    idx = text.find("\n  --speculative-algorithm")
    if idx >= 0:
        block = text[idx + 1: idx + 1500]
        end = re.search(r"\n  -", block[3:])
        block = block[: end.start() + 3] if end else block
        b = _BUILTINS.search(" ".join(block.split()))
        if b:
            algos.update(a.strip().upper() for a in b.group(1).split(",") if a.strip())
    if "--speculative-ddtree-budget" in flags:
        algos.add("DDTREE")
    return frozenset(algos)


# -- running the interpreter ---------------------------------------------------------------------


def _run(argv: list[str], timeout_s: float, log_path: Path | None) -> tuple[int, str, str]:
    """Run in a new session in a scratch folder (so a local `sglang/` folder cannot shadow the
    install), kill the whole group on timeout, always reap."""
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    with tempfile.TemporaryDirectory(prefix="ddtree-probe-") as cwd:
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    cwd=cwd, env=env, start_new_session=True, text=True, errors="replace")
        except OSError as exc:
            raise ProbeError(f"cannot run {argv[0]}: {exc.strerror or exc}",
                             "set engine.python to the interpreter that has the engine installed") from None
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            _write_log(log_path, argv, None, out, err)
            raise ProbeError(f"{' '.join(argv[:4])} did not answer within {timeout_s:g}s",
                             f"see {log_path}" if log_path else "is the interpreter importing something slow?") from None
    _write_log(log_path, argv, proc.returncode, out, err)
    return proc.returncode, out, err


def _write_log(path: Path | None, argv: list[str], rc: int | None, out: str, err: str) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"$ {' '.join(argv)}\n# exit: {rc}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    except OSError:
        pass  # the log is a convenience; the probe result does not depend on it


def _failure(what: str, python: str, rc: int, out: str, err: str) -> ProbeError:
    from ddtree.engine.serving.logclass import classify

    verdict = classify(err + "\n" + out)
    reason = verdict.reason if verdict else f"exit code {rc}"
    last = next((ln.strip() for ln in reversed((err or out).splitlines()) if ln.strip()), "")
    hint = "set engine.python to the interpreter that has it installed" if verdict and verdict.code == "import_error" \
        else (last[:200] or None)
    return ProbeError(f"{python} could not {what}: {reason}", hint)


def installed_version(kind: str, python: str, *, timeout_s: float = VERSION_TIMEOUT_S,
                      log_dir: Path | None = None) -> str:
    log = log_dir / f"probe-{kind}-version.log" if log_dir else None
    rc, out, err = _run([python, "-c", _VERSION_SCRIPT, kind], timeout_s, log)
    if rc != 0:
        raise _failure(f"import {kind}", python, rc, out, err)
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def help_command(kind: str, python: str) -> list[str]:
    if kind == "sglang":
        return [python, "-m", "sglang.launch_server", "--help"]
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"]


def capabilities_from_help(kind: str, python: str, version: str | None, help_text: str,
                           methods: frozenset[str] | None = None) -> Capabilities:
    """Build Capabilities from a help text (recorded or live)."""
    flags = parse_help_flags(help_text)
    notes: list[str] = []
    if kind == "sglang":
        algos = parse_sglang_algorithms(help_text, flags)
        if "--speculative-algorithm" in flags and not algos:
            notes.append("the help text names no speculative algorithms")
    else:
        algos = frozenset(methods or ())
        if "--speculative-config" not in flags:
            notes.append("no --speculative-config flag: this vLLM cannot run a drafter")
    return Capabilities(kind=kind, python=python, version=version, flags=flags, algorithms=algos,
                        probed_at=time.time(), notes=tuple(notes))


def _probe_live(kind: str, python: str, version: str, timeout_s: float, log_dir: Path | None) -> Capabilities:
    log = log_dir / f"probe-{kind}-help.log" if log_dir else None
    rc, out, err = _run(help_command(kind, python), timeout_s, log)
    text = out if "usage:" in out else (out + "\n" + err)
    if "usage:" not in text:
        raise _failure(f"print {kind}'s server help", python, rc, out, err)
    methods = None
    if kind == "vllm":
        rc2, out2, err2 = _run([python, "-c", _VLLM_METHODS_SCRIPT], VERSION_TIMEOUT_S, None)
        if rc2 == 0:
            try:
                methods = frozenset(json.loads(out2.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                methods = frozenset()
    return capabilities_from_help(kind, python, version, text, methods)


# -- the cache -----------------------------------------------------------------------------------

_MEMO: dict[str, Capabilities] = {}


def _cache_key(kind: str, python: str) -> str:
    path = os.path.abspath(python)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        mtime = 0
    return f"{kind}|{path}|{mtime}"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("probes"), dict):
        return {}
    return data["probes"]


def _write_cache(path: Path, probes: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "probes": probes}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-probe next time


def _resolve_python(python: str) -> str:
    import shutil

    if os.sep in python:
        if not os.path.exists(python):
            raise LaunchConfigError(f"engine.python {python} does not exist",
                                    "point it at the interpreter of the venv that has the engine installed")
        return os.path.abspath(python)
    found = shutil.which(python)
    if found is None:
        raise LaunchConfigError(f"engine.python {python!r} is not on PATH", "give the interpreter's full path")
    return found


def probe(kind: str, python: str, *, cache_dir: str | os.PathLike | None = None, refresh: bool = False,
          timeout_s: float = PROBE_TIMEOUT_S) -> Capabilities:
    """Capabilities of `kind` ("sglang" | "vllm") installed for interpreter `python`.

    Cached in memory and, with `cache_dir`, on disk; the cached entry is used only while the
    interpreter's mtime and the installed package version are unchanged (the version check costs
    one short interpreter start; the help run, which imports torch, happens once)."""
    if kind not in KINDS:
        raise LaunchConfigError(f"cannot probe engine kind {kind!r}", "use one of: " + ", ".join(KINDS))
    python = _resolve_python(python)
    log_dir = Path(cache_dir) / "logs" if cache_dir is not None else None
    key = _cache_key(kind, python)
    version = installed_version(kind, python, log_dir=log_dir)
    cache_path = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    if not refresh:
        hit = _MEMO.get(key)
        if hit is None and cache_path is not None:
            stored = _read_cache(cache_path).get(key)
            if isinstance(stored, dict):
                try:
                    hit = Capabilities.from_dict(stored)
                except (KeyError, TypeError, ValueError, EngineError):
                    hit = None
        if hit is not None and hit.version == version:
            _MEMO[key] = hit
            return hit
    caps = _probe_live(kind, python, version, timeout_s, log_dir)
    _MEMO[key] = caps
    if cache_path is not None:
        probes = _read_cache(cache_path)
        probes[key] = caps.to_dict()
        _write_cache(cache_path, probes)
    return caps
