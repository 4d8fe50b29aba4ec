"""Sweep recipes: TOML (docs/design.md, Recipes) -> frozen, validated dataclasses, and back.

`load_recipe(path)` / `parse_recipe(text)` / `recipe_from_dict(data)` read one; `recipe_to_dict`
and `recipe_to_toml` write the canonical form that `export --format recipe` prints and that parses
back to an equal `Recipe`. Every axis of `[sweep]` accepts a scalar or a list; lists become tuples.
Errors name the key (as `section.key`) and the allowed values, and exit with code 2.

Beyond the example in docs/design.md, `[engine]` takes `budget`, `device`, `api` ("generate" | "openai"),
`ready_timeout_s` (SGLang loads take minutes: default 600) and, for kind sglang, `draft_window`
(SGLang's drafter attention window, `--speculative-draft-window-size`). kind sglang/vllm needs
`model`; `python` is the interpreter that has the engine installed (default: this one). `backend`
(kind builtin only) is the builtin server's `--backend`: "auto" (default), "fast" or "transformers".
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.engine.serving.launch import ALGORITHMS, BACKENDS, check_builtin_extra_args
from ddtree.engine.serving.probe import LaunchConfigError
from ddtree.engine.serving.launch import KINDS as ENGINE_KINDS
from ddtree.jobs.errors import BadSpec

BASELINES = ("ar", "dflash")
APIS = ("generate", "openai")
DEVICES = ("cpu", "cuda")  # a sweep's; an engine job may also name one GPU, cuda:N
NUMA_BINDS = ("auto", "off")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:[0-9]{1,2})?)$")


class RecipeError(BadSpec):
    """A recipe that cannot be run as written: a typo'd key, a wrong type, an empty axis."""

    exit_code = 2


def _where(section: str | None, key: str) -> str:
    return f"{section}.{key}" if section else key


def _check_keys(section: str | None, data: dict, allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            near = [k for k in allowed if k.replace("_", "") == key.replace("_", "").replace("-", "")]
            near = near or difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
            hint = f"did you mean '{near[0]}'?" if near else "allowed: " + ", ".join(allowed)
            raise RecipeError(f"unknown key '{_where(section, key)}'", hint)


def _typename(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


#: Upper bounds checked before anything starts (a value past them passed validation and failed
#: only once an engine was up, or overflowed SQLite's 64-bit integers when the points were written).
#: MAX_BUDGET is the builtin engine's node budget maximum (engine/reference/engine.py
#: DEFAULT_MAX_BUDGET; not imported, that module loads torch).
MAX_BUDGET = 1024
#: The builtin engine refuses a block longer than its drafter's trained one (engine/reference/engine.py,
#: known only once the drafter is loaded); the DFlash drafters are trained with 16 or fewer, so
#: this catches a typo at once while leaving room for a drafter trained longer.
MAX_BLOCK_SIZE = 64
MAX_NEW_TOKENS = 1 << 20
MAX_TEMPERATURE = 100.0
MAX_PROMPTS = 1 << 20  # num_prompts and concurrency: a point sends this many requests at most
MAX_INT = 2**63 - 1
#: [sweep]'s counts, (lowest, highest): checked alike on the TOML and on a built SweepSpec, so a
#: value gets the same one message whichever way it comes.
COUNT_BOUNDS = {"num_prompts": (1, MAX_PROMPTS), "max_new_tokens": (1, MAX_NEW_TOKENS), "warmup": (0, MAX_INT),
                "repeats": (1, MAX_INT), "seed": (0, MAX_INT)}


def _want_int(where: str, value: Any, minimum: int = 0, maximum: int = MAX_INT, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecipeError(f"{where} must be an integer, got {_typename(value)} {value!r}")
    if value < minimum:
        raise RecipeError(f"{where} must be >= {minimum}, got {value}")
    if value > maximum:
        raise RecipeError(f"{where} must be <= {maximum}{why}, got {value}")
    return value


def _want_budget(where: str, value: Any) -> int:
    return _want_int(where, value, 0, MAX_BUDGET, " (the engine's maximum node budget)")


def _want_temperature(where: str, value: Any) -> float:
    value = _want_float(where, value, 0.0)
    if not value <= MAX_TEMPERATURE:
        raise RecipeError(f"{where} must be a finite number <= {MAX_TEMPERATURE:g}, got {value}")
    return value


def _want_float(where: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecipeError(f"{where} must be a number, got {_typename(value)} {value!r}")
    value = float(value)
    # inf passes `>= minimum`; as a timeout or a limit it would wait or run forever
    if not math.isfinite(value) or value < minimum:
        raise RecipeError(f"{where} must be a finite number >= {minimum:g}, got {value}")
    return value


def _want_sweep_device(value: Any) -> str:
    """A recipe's engine.device: an engine job may name one GPU (cuda:N), a sweep may not."""
    return _want_str("engine.device", value, DEVICES, "a sweep places its GPUs with engine.gpus, not cuda:N")


def _want_str(where: str, value: Any, choices: tuple[str, ...] | None = None, why: str = "") -> str:
    if not isinstance(value, str):
        raise RecipeError(f"{where} must be a string, got {_typename(value)} {value!r}")
    if choices is not None and value not in choices:
        hint = "allowed: " + ", ".join(choices) + (f"; {why}" if why else "")
        raise RecipeError(f"{where} = {value!r} is not allowed", hint)
    if choices is None and not value.strip():
        raise RecipeError(f"{where} must not be empty")
    return value


def _axis(where: str, value: Any, check) -> tuple:
    """A grid axis: a scalar means one value; a list must be non-empty and free of repeats."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise RecipeError(f"{where} is an empty list", "give at least one value, or leave the key out")
    out = tuple(check(f"{where}[{i}]" if isinstance(value, (list, tuple)) else where, v)
                for i, v in enumerate(values))
    if len(set(out)) != len(out):
        raise RecipeError(f"{where} lists a value twice: {list(values)!r}")
    return out


@dataclass(frozen=True)
class EngineSpec:
    """The `[engine]` table: what to launch. `model`/`draft_model` None mean the demo pair (builtin).
The one engine schema: a recipe's `[engine]` and an `engine` job's spec are both read into it.

    `draft_window` (sglang only): the drafter's attention window over the context, passed to
    SGLang's draft-window flag (`--speculative-draft-window-size`; the name the installed build
    accepts is used). Left out, SGLang's default applies.

    `backend` (builtin only): "auto" takes the fast forward for dense Qwen3/Qwen2/Llama/Mistral
    targets on CUDA and transformers otherwise; "fast" or "transformers" force one.
    """

    kind: str = "builtin"
    python: str | None = None
    model: str | None = None
    draft_model: str | None = None
    algorithm: str = "ddtree"
    budget: int | None = None
    block_size: int | None = None
    device: str = "cpu"
    gpus: tuple[int, ...] = ()
    numa_bind: str = "off"
    api: str | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    ready_timeout_s: float = 600.0
    draft_window: int | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        _want_str("engine.kind", self.kind, ENGINE_KINDS)
        _want_str("engine.backend", self.backend, BACKENDS)
        if self.kind != "builtin" and self.backend != "auto":
            raise RecipeError(f"engine.backend applies to kind = \"builtin\" only, not {self.kind!r}",
                              "leave it out")
        _want_str("engine.algorithm", self.algorithm, ALGORITHMS)
        if not _DEVICE_RE.match(_want_str("engine.device", self.device)):
            raise RecipeError(f"engine.device = {self.device!r} is not allowed", "allowed: cpu, cuda, cuda:N")
        _want_str("engine.numa_bind", self.numa_bind, NUMA_BINDS)
        for key in ("python", "model", "draft_model"):
            if getattr(self, key) is not None:
                _want_str(f"engine.{key}", getattr(self, key))
        if self.api is not None:
            _want_str("engine.api", self.api, APIS)
        if self.budget is not None:
            _want_budget("engine.budget", self.budget)
        if self.block_size is not None:
            _want_int("engine.block_size", self.block_size, 2, MAX_BLOCK_SIZE)
        if self.draft_window is not None:
            _want_int("engine.draft_window", self.draft_window, 1)
            if self.kind != "sglang":
                raise RecipeError(f"engine.draft_window applies to kind = \"sglang\" only, not {self.kind!r}",
                                  "leave it out")
        if self.kind in ("sglang", "vllm") and self.model is None:
            raise RecipeError(f"engine.model is required for kind = \"{self.kind}\"",
                              "a local model directory or a hub repo id (the demo pair is for kind builtin)")
        for i, gpu in enumerate(self.gpus):
            _want_int(f"engine.gpus[{i}]", gpu, 0)
        if len(set(self.gpus)) != len(self.gpus):
            raise RecipeError(f"engine.gpus lists a GPU twice: {list(self.gpus)}")
        for i, arg in enumerate(self.extra_args):
            if not isinstance(arg, str):
                raise RecipeError(f"engine.extra_args[{i}] must be a string, got {_typename(arg)}")
        for name, value in self.env:
            if not isinstance(value, str):
                raise RecipeError(f"engine.env.{name} must be a string, got {_typename(value)}")
        _want_float("engine.ready_timeout_s", self.ready_timeout_s, 1.0)
        if self.kind == "builtin" and self.numa_bind != "off":
            raise RecipeError("engine.numa_bind applies to sglang and vllm only", "leave it out for builtin")

    @property
    def request_api(self) -> str:
        """The HTTP API the benchmark client speaks: SGLang's /generate unless told otherwise."""
        if self.api is not None:
            return self.api
        return "openai" if self.kind == "vllm" else "generate"

    @property
    def per_request_spec(self) -> bool:
        """The builtin engine takes algorithm and budget per request; the others fix them at launch."""
        return self.kind == "builtin"


@dataclass(frozen=True)
class SweepSpec:
    """The `[sweep]` table: the grid (tuples are axes) and the fixed client settings."""

    algorithm: tuple[str, ...] = ()
    budget: tuple[int, ...] = ()
    tp: tuple[int, ...] = (1,)
    gpus: tuple[tuple[int, ...], ...] = ()
    concurrency: tuple[int, ...] = (1,)
    dataset: tuple[str, ...] = ("builtin:code",)
    temperature: tuple[float, ...] = (0.0,)
    num_prompts: int = 16
    max_new_tokens: int = 128
    warmup: int = 2
    repeats: int = 1
    baseline: tuple[str, ...] = ()
    request_rate: float | None = None
    seed: int = 0
    timeout_s: float = 600.0
    stop_error_rate: float = 0.5
    stop_e2e_p99_s: float | None = None
    # A cell whose repeats' output tok/s vary by a coefficient of variation above this is unstable.
    unstable_spread: float = 0.10
    # Repeats of different grid cells alternate (A B C A B C) so that drift in the machine's load
    # hits every cell alike; false runs each cell's repeats back to back (A A B B C C).
    interleave: bool = True

    def __post_init__(self) -> None:
        for key in ("algorithm", "budget", "tp", "gpus", "concurrency", "dataset", "temperature"):
            if not isinstance(getattr(self, key), tuple):
                raise RecipeError(f"sweep.{key} must be a tuple of values")
        if not (self.concurrency and self.dataset and self.temperature and self.tp):
            raise RecipeError("sweep axes concurrency, dataset, temperature and tp need at least one value")
        for key, (low, high) in COUNT_BOUNDS.items():
            _want_int(f"sweep.{key}", getattr(self, key), low, high)
        _want_float("sweep.timeout_s", self.timeout_s, 1.0)
        _want_float("sweep.stop_error_rate", self.stop_error_rate, 0.0)
        if self.stop_error_rate > 1.0:
            raise RecipeError(f"sweep.stop_error_rate must be in [0, 1], got {self.stop_error_rate}")
        _want_float("sweep.unstable_spread", self.unstable_spread, 0.0)
        if not isinstance(self.interleave, bool):
            raise RecipeError(f"sweep.interleave must be true or false, got {_typename(self.interleave)} "
                              f"{self.interleave!r}")
        if self.request_rate is not None and _want_float("sweep.request_rate", self.request_rate) <= 0:
            raise RecipeError("sweep.request_rate must be > 0", "leave it out to send as fast as concurrency allows")
        if self.stop_e2e_p99_s is not None and _want_float("sweep.stop_e2e_p99_s", self.stop_e2e_p99_s) <= 0:
            raise RecipeError("sweep.stop_e2e_p99_s must be > 0")
        for b in self.baseline:
            _want_str("sweep.baseline", b, BASELINES)
        if len(set(self.baseline)) != len(self.baseline):
            raise RecipeError(f"sweep.baseline lists a value twice: {list(self.baseline)}")


@dataclass(frozen=True)
class Recipe:
    """A whole recipe. `source` is not part of equality: two recipes are equal when they run the same."""

    name: str
    engine: EngineSpec = field(default_factory=EngineSpec)
    sweep: SweepSpec = field(default_factory=SweepSpec)

    def __post_init__(self) -> None:
        _want_str("name", self.name)
        engine, sweep = self.engine, self.sweep
        _want_sweep_device(engine.device)
        algorithms = self.algorithms
        if sweep.budget and "ddtree" not in algorithms:
            raise RecipeError(
                f"sweep.budget is set but the algorithm is {', '.join(algorithms)}",
                "a node budget applies to algorithm ddtree only; remove sweep.budget or set algorithm = \"ddtree\"",
            )
        if engine.budget is not None and "ddtree" not in algorithms:
            raise RecipeError(
                f"engine.budget is set but the algorithm is {', '.join(algorithms)}",
                "a node budget applies to algorithm ddtree only",
            )
        if engine.kind == "builtin":
            if sweep.tp != (1,):
                raise RecipeError(f"sweep.tp = {list(sweep.tp)} but the builtin engine runs on one device",
                                  "leave sweep.tp out for kind = \"builtin\"")
            if sweep.gpus or len(engine.gpus) > 1:
                raise RecipeError("the builtin engine runs on one device", "give at most one GPU in engine.gpus")
            try:
                check_builtin_extra_args(engine.extra_args)
            except LaunchConfigError as exc:
                raise RecipeError(exc.message, exc.hint) from None
        pool = len(engine.gpus)
        for tp in sweep.tp:
            if pool and not sweep.gpus and tp > pool:
                raise RecipeError(f"sweep.tp = {tp} needs {tp} GPUs but engine.gpus has {pool}")
        for gpus in sweep.gpus:
            for tp in sweep.tp:
                if tp > len(gpus):
                    raise RecipeError(f"sweep.tp = {tp} needs {tp} GPUs but sweep.gpus entry {list(gpus)} has {len(gpus)}")

    @property
    def algorithms(self) -> tuple[str, ...]:
        """The measured algorithms (the axis, or the engine's one); baselines come on top."""
        return self.sweep.algorithm or (self.engine.algorithm,)

    @property
    def budgets(self) -> tuple[int | None, ...]:
        if self.sweep.budget:
            return self.sweep.budget
        return (self.engine.budget,)


_ENGINE_KEYS = tuple(EngineSpec.__dataclass_fields__)
_SWEEP_KEYS = tuple(SweepSpec.__dataclass_fields__)
_TOP_KEYS = ("name", "engine", "sweep")


def _check_gpu_list(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise RecipeError(f"{where} must be a list of GPU indices, got {_typename(value)} {value!r}")
    if not value:
        raise RecipeError(f"{where} is an empty list")
    return tuple(_want_int(f"{where}[{i}]", g, 0) for i, g in enumerate(value))


def engine_from_dict(data: Any, *, allowed: tuple[str, ...] = _ENGINE_KEYS) -> EngineSpec:
    """Validate an `[engine]` table (TOML types: lists and tables) into an `EngineSpec`; `allowed`
    narrows the keys taken (an engine job has no use for a sweep's settings)."""
    if not isinstance(data, dict):
        raise RecipeError(f"engine must be a table, got {_typename(data)}")
    _check_keys("engine", data, allowed)
    kw = dict(data)
    if "gpus" in kw:
        if not isinstance(kw["gpus"], list):
            raise RecipeError(f"engine.gpus must be a list of GPU indices, got {_typename(kw['gpus'])}")
        kw["gpus"] = tuple(_want_int(f"engine.gpus[{i}]", g, 0) for i, g in enumerate(kw["gpus"]))
    if "extra_args" in kw:
        if not isinstance(kw["extra_args"], list):
            raise RecipeError(f"engine.extra_args must be a list of strings, got {_typename(kw['extra_args'])}")
        kw["extra_args"] = tuple(kw["extra_args"])
    if "env" in kw:
        if not isinstance(kw["env"], dict):
            raise RecipeError(f"engine.env must be a table of strings, got {_typename(kw['env'])}")
        kw["env"] = tuple(sorted(kw["env"].items()))
    for key in ("budget", "block_size", "draft_window"):
        if key in kw:
            _want_int(f"engine.{key}", kw[key], 0)
    if "ready_timeout_s" in kw:
        kw["ready_timeout_s"] = _want_float("engine.ready_timeout_s", kw["ready_timeout_s"], 1.0)
    return EngineSpec(**kw)


def _sweep_from_dict(data: Any) -> SweepSpec:
    if not isinstance(data, dict):
        raise RecipeError(f"sweep must be a table, got {_typename(data)}")
    _check_keys("sweep", data, _SWEEP_KEYS)
    kw = dict(data)
    axes = {
        "algorithm": lambda w, v: _want_str(w, v, ALGORITHMS),
        "budget": _want_budget,
        "tp": lambda w, v: _want_int(w, v, 1),
        "concurrency": lambda w, v: _want_int(w, v, 1, MAX_PROMPTS),
        "dataset": lambda w, v: _want_str(w, v),
        "temperature": _want_temperature,
    }
    for key, check in axes.items():
        if key in kw:
            kw[key] = _axis(f"sweep.{key}", kw[key], check)
    if "gpus" in kw:
        value = kw["gpus"]
        if not isinstance(value, list) or not value:
            raise RecipeError("sweep.gpus must be a non-empty list of GPU lists, e.g. [[0, 1], [0, 1, 2, 3]]")
        kw["gpus"] = tuple(_check_gpu_list(f"sweep.gpus[{i}]", g) for i, g in enumerate(value))
    if "baseline" in kw:
        kw["baseline"] = _axis("sweep.baseline", kw["baseline"], lambda w, v: _want_str(w, v, BASELINES))
    for key in ("timeout_s", "stop_error_rate", "unstable_spread", "request_rate", "stop_e2e_p99_s"):
        if key in kw:
            kw[key] = _want_float(f"sweep.{key}", kw[key], 1.0 if key == "timeout_s" else 0.0)
    for key, (low, high) in COUNT_BOUNDS.items():
        if key in kw:
            _want_int(f"sweep.{key}", kw[key], low, high)
    return SweepSpec(**kw)


def recipe_from_dict(data: Any) -> Recipe:
    """Validate a parsed TOML document (or `recipe_to_dict`'s output) into a `Recipe`."""
    if not isinstance(data, dict):
        raise RecipeError(f"a recipe must be a table, got {_typename(data)}")
    _check_keys(None, data, _TOP_KEYS)
    if "name" not in data:
        raise RecipeError("missing key 'name'", 'add name = "my-sweep" at the top')
    engine_table = data.get("engine", {})
    if isinstance(engine_table, dict) and "device" in engine_table:
        # Before the engine table's own check, which allows the cuda:N a sweep refuses.
        _want_sweep_device(engine_table["device"])
    engine = engine_from_dict(engine_table)
    sweep = _sweep_from_dict(data.get("sweep", {}))
    return Recipe(name=_want_str("name", data["name"]), engine=engine, sweep=sweep)


def parse_recipe(text: str, *, source: str = "recipe") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{source} is not valid TOML: {exc}") from None
    except ValueError:  # tomllib's int() past Python's 4300-digit limit
        raise RecipeError(f"{source} is not valid TOML: a number has more digits than any key takes") from None
    return recipe_from_dict(data)


def load_recipe(path: str | Path) -> Recipe:
    if isinstance(path, str) and not path.strip():
        # Path("") is ".", which read as "cannot read recipe .: Is a directory"
        raise RecipeError("the recipe file name is empty", "e.g. assets/recipes/demo.toml")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}", "the shipped ones are in assets/recipes") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc}") from None
    return parse_recipe(text, source=str(path))


def recipe_to_dict(recipe: Recipe, *, explicit: bool = False) -> dict:
    """The canonical dict (TOML/JSON types only); defaults and None are left out of the tables,
    unless `explicit`, which writes every setting that has a value (None has no TOML form)."""
    def table(obj, defaults) -> dict:
        out = {}
        for key in obj.__dataclass_fields__:
            value = getattr(obj, key)
            if value is None or (not explicit and value == getattr(defaults, key)):
                continue
            if explicit and value == () and value == getattr(defaults, key):
                continue  # an axis left empty means "not an axis"; TOML's [] would read as an error
            if key == "env":
                value = dict(value)
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[key] = value
        return out

    return {"name": recipe.name, "engine": table(recipe.engine, EngineSpec()), "sweep": table(recipe.sweep, SweepSpec())}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are a subset of TOML basic-string escapes.
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise RecipeError(f"cannot write {type(value).__name__} to TOML")


def recipe_to_toml(recipe: Recipe, *, comment: str | None = None, explicit: bool = False) -> str:
    """TOML that `parse_recipe` reads back to an equal recipe (`explicit`: every setting written)."""
    data = recipe_to_dict(recipe, explicit=explicit)
    lines = [f"# {line}" for line in (comment or "").splitlines()]
    lines.append(f"name = {_toml_value(data['name'])}")
    for section in ("engine", "sweep"):
        lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in data[section].items())
    return "\n".join(lines) + "\n"
