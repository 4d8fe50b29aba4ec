"""Expand a recipe into the ordered sweep plan: every engine launch and every point.

Server-side axes (tp, gpus, and algorithm/budget for engines that fix them at launch) give one
engine launch each; client-side axes (concurrency, dataset, temperature) and repeats reuse it.
The builtin engine takes the algorithm and budget per request, so for it those are client-side too.
Baselines (`sweep.baseline`) are measured at every server setting, before the measured algorithms,
so each point's speedup compares like with like.

SGLang and vLLM launches are built by `ddtree.engine.serving.launch.build_launch` from what the recipe's
interpreter says it accepts (one probe per plan, cached on disk under `cache_dir`), with NUMA
pinning from `ddtree.engine.machine.placement` when `numa_bind = "auto"` and the hardware is known. A launch
that cannot be built (no DDTREE in this SGLang, a flag the build lacks, tp that does not divide the
GPUs, a model that does not fit; for the builtin engine, dflash or ddtree on a target whose
config.json shows recurrent layers, which it decodes with ar only) stays in the plan with
`unsupported` set to the reason: the dry run shows it, `check_plan` refuses it before a real run.

`make_plan(recipe)` starts nothing (it may run the engine's interpreter with `--help`, once);
`Plan.to_dict()` is what `sweep --dry-run --json` prints.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ddtree.engine.arch import SPECULATIVE_HINT, read_config
from ddtree.engine.arch import builtin_refusal as arch_refusal
from ddtree.engine.errors import EngineError
from ddtree.engine.units import duration, plural
from ddtree.engine.serving.launch import DEFAULT_MAX_RUNNING, LaunchSpec, build_launch, builtin_argv, free_port
from ddtree.engine.machine.placement import suggest
from ddtree.engine.machine.preflight import check_gpus, preflight
from ddtree.engine.serving.probe import Capabilities
from ddtree.engine.serving.probe import probe as probe_engine
from ddtree.engine.serving.prompts import DatasetError, DatasetNotFound, read_prompts, resolve_dataset
from ddtree.jobs.errors import JobError
from ddtree.jobs.recipe import EngineSpec, Recipe

# Assumed decode speed per request stream and engine start-up time, for the estimate only: the
# dry-run says they are assumptions, and the caller may pass a rate measured in an earlier run.
ASSUMED_STREAM_TOK_S = {"builtin-cpu": 60.0, "builtin-cuda": 40.0, "sglang": 80.0, "vllm": 80.0}
ASSUMED_START_S = {"builtin-cpu": 8.0, "builtin-cuda": 20.0, "sglang": 180.0, "vllm": 180.0}

class UnsupportedEngine(JobError):
    """A launch of the plan cannot be built as the recipe asks (the reason names why)."""

    exit_code = 2


@dataclass(frozen=True)
class Hardware:
    """What the plan knows of this machine (NVML's GPUs and links, the NUMA nodes); empty: unknown."""

    gpus: tuple = ()
    links: tuple = ()
    numa: tuple = ()
    reason: str | None = None

    @classmethod
    def detect(cls) -> Hardware:
        from ddtree.engine.machine.host import numa_nodes
        from ddtree.engine.machine.hw import gpu_view

        view = gpu_view()
        return cls(gpus=tuple(view.gpus), links=tuple(tuple(row) for row in view.links),
                   numa=tuple(numa_nodes()), reason=view.reason)


@dataclass(frozen=True)
class Launch:
    """One engine process: started when its first point comes up, stopped after its last.

    `argv`/`env` are what the dry run shows (for sglang/vllm with a port free at planning time;
    the runner rebuilds the spec with a port free when it starts the engine). `numa_nodes` and
    `numa_cpus` are the placement the spec was built with; `unsupported` the reason it could not
    be built (then `argv` is None)."""

    index: int
    tp: int
    gpus: tuple[int, ...]
    algorithm: str
    budget: int | None
    argv: tuple[str, ...] | None
    env: tuple[tuple[str, str], ...]
    est_start_s: float
    unsupported: str | None = None
    kind: str = "builtin"
    command: str | None = None
    numa: str = "off"
    numa_nodes: tuple[int, ...] = ()
    numa_cpus: tuple[int, ...] = ()
    cpu_affinity: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"index": self.index, "kind": self.kind, "tp": self.tp, "gpus": list(self.gpus),
                "algorithm": self.algorithm, "budget": self.budget,
                "argv": list(self.argv) if self.argv is not None else None, "env": dict(self.env),
                "command": self.command, "numa": self.numa, "cpu_affinity": list(self.cpu_affinity),
                "notes": list(self.notes), "est_start_s": round(self.est_start_s, 1),
                "unsupported": self.unsupported}


@dataclass(frozen=True)
class PlanPoint:
    """One grid cell at one repeat. `key` identifies it within a run (resume matches on it)."""

    index: int
    launch: int
    engine_kind: str
    algorithm: str
    budget: int | None
    tp: int
    gpus: tuple[int, ...]
    concurrency: int
    dataset: str
    temperature: float
    repeat: int
    baseline: bool
    est_s: float

    @property
    def key(self) -> str:
        return point_key(self.params())

    @property
    def series(self) -> tuple:
        """Points that differ only in concurrency and repeat: saturation stops a series early."""
        return (self.launch, self.algorithm, self.budget, self.dataset, self.temperature)

    def params(self) -> dict:
        return {"engine_kind": self.engine_kind, "algorithm": self.algorithm, "budget": self.budget,
                "tp": self.tp, "gpus": list(self.gpus), "concurrency": self.concurrency,
                "dataset": self.dataset, "temperature": self.temperature, "repeat": self.repeat}

    def to_dict(self) -> dict:
        return {"index": self.index, "launch": self.launch, "key": self.key, **self.params(),
                "baseline": self.baseline, "est_s": round(self.est_s, 1)}


def point_key(params: dict) -> str:
    """A stable text key for a point's parameters (the same dict shape as `PlanPoint.params`)."""
    names = ("engine_kind", "algorithm", "budget", "tp", "gpus", "concurrency", "dataset", "temperature", "repeat")
    values = dict(params)
    values["temperature"] = float(values["temperature"])
    values["gpus"] = list(values.get("gpus") or [])
    return json.dumps({n: values[n] for n in names}, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    launches: tuple[Launch, ...]
    points: tuple[PlanPoint, ...]
    warnings: tuple[str, ...] = ()
    assumed_stream_tok_s: float = 0.0
    est_total_s: float = field(default=0.0)
    caps: Capabilities | None = None  # what the sglang/vllm interpreter accepts (None: builtin, or no answer)
    cache_dir: str | None = None

    @cached_property
    def box(self) -> dict:
        """What competes for this machine now (measured once, when the plan is first shown; a sweep
        then records it per point): {"busy", "note", "reasons", "load1", "cpu_percent", "others_cores",
        "gpu_reason"}."""
        gpus = tuple(sorted({g for launch in self.launches for g in launch.gpus}))
        return box_check(gpus)

    def to_dict(self) -> dict:
        engine = None
        if self.caps is not None:
            engine = {"kind": self.caps.kind, "python": self.caps.python, "version": self.caps.version,
                      "algorithms": sorted(self.caps.algorithms)}
        return {
            "name": self.recipe.name,
            "engine_kind": self.recipe.engine.kind,
            "engine": engine,
            "launches": [launch.to_dict() for launch in self.launches],
            "points": [point.to_dict() for point in self.points],
            "warnings": list(self.warnings),
            "repeats": {"count": self.recipe.sweep.repeats, "warmup": self.recipe.sweep.warmup,
                        "order": "interleaved" if self.recipe.sweep.interleave else "grouped",
                        "note": repeat_note(self.recipe)},
            "estimate": {"total_s": round(self.est_total_s, 1), "stream_tok_s": self.assumed_stream_tok_s,
                         "note": "assumes this decode speed per request stream; not measured"},
            "box": self.box,
        }

    def launch_spec(self, launch: Launch, *, port: int | None = None) -> LaunchSpec:
        """The spec to start `launch` now. sglang/vllm get a port free now (the one in the dry
        run may be taken since) and the capabilities probed for the plan; raises EngineError
        (LaunchConfigError, ProbeError) when it cannot be built."""
        if launch.unsupported is not None:
            raise UnsupportedEngine(f"launch {launch.index} cannot start: {launch.unsupported}")
        if launch.kind == "builtin":
            return LaunchSpec(kind="builtin", argv=launch.argv, env=dict(launch.env), port=0, announces_url=True,
                              algorithm=launch.algorithm, budget=launch.budget, tp=launch.tp, gpus=launch.gpus)
        return _engine_spec(self.recipe, launch.algorithm, launch.budget, launch.tp, launch.gpus,
                            port=port or free_port(), caps=self.caps, cache_dir=self.cache_dir,
                            numa_nodes=launch.numa_nodes, numa_cpus=launch.numa_cpus)


#: Grids larger than this are refused unless the operator says so (`sweep --yes-large`): a typo'd
#: axis (1000 x 100) wrote 100,000 point rows before its first point.
MAX_POINTS = 10_000
#: Refused even with --yes-large: the plan is built in memory point by point, so a grid of billions
#: grew without limit; at even a few seconds a point this many would take days.
HARD_MAX_POINTS = 100_000


def grid_size(recipe: Recipe) -> int:
    """How many points `make_plan` would plan, counted from the axes without building them."""
    sweep = recipe.sweep
    return (len(_gpu_sets(recipe)) * len(_specs(recipe)) * len(sweep.dataset) * len(sweep.temperature)
            * len(sweep.concurrency) * sweep.repeats)


def check_size(recipe: Recipe, *, allow_large: bool = False) -> None:
    """Refuse (exit 2) a grid over MAX_POINTS points (over HARD_MAX_POINTS even when
    `allow_large`), before it is planned or stored."""
    size = grid_size(recipe)
    if size > HARD_MAX_POINTS:
        raise UnsupportedEngine(f"sweep grid has {size:,} points (more than {HARD_MAX_POINTS:,}, "
                                "the most a sweep may have even with --yes-large)",
                                "shrink the axes of [sweep], or split it into several recipes")
    if size > MAX_POINTS and not allow_large:
        raise UnsupportedEngine(f"sweep grid has {size:,} points (more than {MAX_POINTS:,})",
                                "shrink the axes of [sweep], or pass --yes-large to run it anyway")


def _check_local(key: str, value: str | None) -> None:
    """A model given as a local path (absolute, ./, ../ or ~) must exist; a hub repo id is checked
    by the engine when it downloads."""
    if value is None or not value.startswith(("/", "./", "../", "~")):
        return
    if not Path(value).expanduser().exists():
        raise UnsupportedEngine(f"{key} = {value!r}: no such file or folder",
                                "give a local model folder that exists, or a hub repo id")


def check_datasets(recipe: Recipe, *, missing_ok: bool = False) -> None:
    """Refuse (DatasetError, exit 2) a prompt set that cannot be found or read. The dry run and a
    real start both call it: it is bad input in the recipe, not a launch the plan can show.
    missing_ok (`sweep --dry-run --no-probe`, which checks nothing of this machine): a prompt file
    or named set that is not here may be on the machine that will run the sweep, so it is not
    refused; the plan's warnings say it once (make_plan). One that is here and unreadable, or a
    builtin set that is not shipped, is refused all the same."""
    for name in recipe.sweep.dataset:
        # Refused here, not as failed points an hour later (read in full: an empty, binary or
        # half-JSON file fails every point).
        try:
            read_prompts(resolve_dataset(name))
        except DatasetError as exc:
            if missing_ok and isinstance(exc, DatasetNotFound):
                continue
            raise DatasetError(f"sweep.dataset {name!r}: {exc}") from None


def check_plan(plan: Plan) -> None:
    """Refuse (exit 2) a plan with a local model that is not there, or a launch that cannot be
    built; the first reason is the message. The prompt sets are `check_datasets`'s."""
    bad = [launch for launch in plan.launches if launch.unsupported is not None]
    if bad:
        first = bad[0]
        more = f" ({len(bad)} of {len(plan.launches)} launches)" if len(bad) > 1 else ""
        raise UnsupportedEngine(f"{plan.recipe.engine.kind} launch {first.index} ({first.algorithm}"
                                + (f" budget {first.budget}" if first.budget is not None else "")
                                + f", tp {first.tp}) cannot start{more}: {first.unsupported}",
                                "`ddtree-console sweep RECIPE --dry-run` shows every launch")
    # After the launches: a refusal read from the target's config says more than a missing drafter.
    _check_local("engine.model", plan.recipe.engine.model)
    _check_local("engine.draft_model", plan.recipe.engine.draft_model)


def demo_pair() -> tuple[str, str]:
    """The demo target and drafter folders (the engine helper's `demo_paths`, else the asset path)."""
    import ddtree.assets

    root = Path(ddtree.assets.__file__).resolve().parent / "demo"
    fallback = (str(root / "target"), str(root / "drafter"))
    try:
        from ddtree.engine.demo import demo_paths
    except ImportError:
        return fallback
    try:
        target, drafter = demo_paths()
    except EngineError:
        # Not installed yet: the plan still shows where it goes; the engine's own error says how to
        # train it when a sweep actually starts it.
        return fallback
    return str(target), str(drafter)


def builtin_refusal(recipe: Recipe, specs: list[tuple[str, int | None]]) -> str | None:
    """Why the builtin engine would refuse one of these (algorithm, budget) on the recipe's target,
    read from its config.json before anything starts (a target with recurrent layers decodes with
    ar only); None when all run, or when the config cannot be read here (the engine checks again)."""
    model = recipe.engine.model
    if model is None:
        return None  # the demo pair is pure attention
    return target_refusal(model, specs)


def target_refusal(model: str, specs: list[tuple[str, int | None]]) -> str | None:
    """`builtin_refusal` for one target folder or hub id (the console's engine form asks it too)."""
    config = read_config(model)
    if config is None:
        return None
    for algorithm, budget in specs:
        why = arch_refusal(config, algorithm, budget)
        if why is not None:
            return f"engine.model {model}: {why} ({SPECULATIVE_HINT})"
    return None


def _builtin_argv(recipe: Recipe, algorithm: str, budget: int | None) -> tuple[str, ...]:
    """The builtin server's command line. With no model (the demo pair) --model is left out: the
    server then loads the demo pair itself and serves it as demo/target, and the plan shows no
    install path (build/__editable__... with an editable install). --draft is left out likewise
    unless the recipe names one. The demo pair's own folders, written out (an exported recipe
    resolves its defaults), count as no model, so such a recipe plans the same command line."""
    engine = recipe.engine
    model = _unless_demo(engine.model, 0)
    # the demo drafter goes without saying only beside the demo target
    draft = _unless_demo(engine.draft_model, 1) if model is None else engine.draft_model
    # The concurrency axis reuses one server: it must run the sweep's highest concurrency at
    # once, or those points would measure its queue (and the fast backend sizes its KV pool
    # from this). Below the server's default the flag goes unsaid.
    widest = max(recipe.sweep.concurrency)
    return tuple(builtin_argv(python=engine.python, model=model, draft=draft,
                              algorithm=algorithm, budget=budget,
                              block_size=engine.block_size, device=engine.device, backend=engine.backend,
                              max_running_requests=widest if widest > DEFAULT_MAX_RUNNING else None)) \
        + tuple(engine.extra_args)


def _unless_demo(path: str | None, which: int) -> str | None:
    """None where `path` is the demo target (which=0) or drafter (1) as installed, else path."""
    if path is None:
        return None
    from ddtree.engine.demo import DemoMissing, demo_paths

    try:
        demo = demo_paths()[which]
    except DemoMissing:
        return path
    try:
        same = Path(path).expanduser().resolve() == demo.resolve()
    except OSError:
        same = False
    return None if same else path


def _specs(recipe: Recipe) -> list[tuple[str, int | None, bool]]:
    """(algorithm, budget, is_baseline) in run order: baselines first, then the measured grid."""
    measured = []
    for algorithm in recipe.algorithms:
        budgets = recipe.budgets if algorithm == "ddtree" else (None,)
        measured.extend((algorithm, budget, False) for budget in budgets)
    present = {(a, b) for a, b, _ in measured}
    baselines = [(b, None, True) for b in recipe.sweep.baseline if (b, None) not in present]
    return baselines + measured


def _gpu_sets(recipe: Recipe) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(tp, the GPUs the server uses, the GPU set they are taken from) per server setting. A
    server with tp N uses the first N GPUs of its set (what CUDA_VISIBLE_DEVICES gives it)."""
    sweep, engine = recipe.sweep, recipe.engine
    if sweep.gpus:
        return [(tp, gpus[:tp], gpus) for gpus in sweep.gpus for tp in sweep.tp]
    return [(tp, engine.gpus[:tp] if engine.gpus else (), engine.gpus) for tp in sweep.tp]


def _env(recipe: Recipe, gpus: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    env = dict(recipe.engine.env)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return tuple(sorted(env.items()))


def _engine_table(engine: EngineSpec, gpus: tuple[int, ...], numa_bind: str) -> dict:
    """The [engine] table as build_launch reads it. GPU indices in recipes are the ones `hw` shows
    (NVML numbers them in PCI bus order), so CUDA must count in that order too, unless the recipe's
    env says otherwise."""
    table = {name: getattr(engine, name) for name in EngineSpec.__dataclass_fields__}
    env = dict(engine.env)
    if gpus:
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    table.update(env=env, numa_bind=numa_bind)
    return table


def _engine_spec(recipe: Recipe, algorithm: str, budget: int | None, tp: int, gpus: tuple[int, ...], *, port: int,
                 caps: Capabilities | None, cache_dir: str | None, numa_nodes: tuple[int, ...],
                 numa_cpus: tuple[int, ...]) -> LaunchSpec:
    # numa_bind "auto" with no placement to pin to (unknown topology, or a set spanning every node)
    # is passed as "auto" only when there is something to pin; otherwise as off, with the reason
    # in the launch's notes.
    numa_bind = recipe.engine.numa_bind if (numa_nodes or numa_cpus) else "off"
    return build_launch(_engine_table(recipe.engine, gpus, numa_bind), algorithm=algorithm,
                        budget=budget if algorithm == "ddtree" else None, tp=tp, gpus=gpus, port=port,
                        numa_node=list(numa_nodes) or None, numa_cpus=list(numa_cpus) or None, caps=caps,
                        cache_dir=cache_dir)


def _placement(recipe: Recipe, gpus: tuple[int, ...], hardware: Hardware | None
               ) -> tuple[tuple[int, ...], tuple[int, ...], list[str]]:
    """(NUMA nodes, local CPUs, notes) to pin a server on `gpus` to, for numa_bind = "auto"."""
    if recipe.engine.numa_bind != "auto" or not gpus:
        return (), (), []
    if hardware is None or not hardware.gpus:
        why = hardware.reason if hardware is not None and hardware.reason else "the GPUs' NUMA node is unknown"
        return (), (), [f"numa_bind auto: nothing pinned ({why})"]
    known = {g.index for g in hardware.gpus}
    if not set(gpus) <= known:
        return (), (), []  # check_gpus names the missing GPU
    others = tuple(i for i in known if i not in gpus)
    place = suggest(list(hardware.gpus), [list(row) for row in hardware.links], len(gpus), numa=list(hardware.numa),
                    limit=1, exclude=others)[0]
    if not place.numactl:
        return (), (), [f"numa_bind auto: {note}" for note in place.notes] or ["numa_bind auto: nothing to pin"]
    return place.numa_nodes, place.cpus, list(place.notes)


def _fit(recipe: Recipe, tp: int, gpus: tuple[int, ...], hardware: Hardware | None) -> None:
    """On a machine whose GPUs are known: the weights fit on the launch's GPUs."""
    if hardware is None or not hardware.gpus or not gpus:
        return
    totals = [g.memory_total for g in hardware.gpus if g.index in gpus]
    if any(t is None for t in totals):
        return
    preflight(recipe.engine.model, recipe.engine.draft_model, totals, tp)


def make_plan(recipe: Recipe, *, stream_tok_s: float | None = None, hardware: Hardware | None = None,
              caps: Capabilities | None = None, cache_dir: str | Path | None = None, probe: bool = True) -> Plan:
    """The whole sweep in run order. `stream_tok_s` overrides the assumed decode speed.

    For sglang/vllm: `caps` are the engine's capabilities (None: probe the recipe's python, cached
    under `cache_dir`); `hardware` (None: not checked) places NUMA pinning and checks that the
    launch's GPUs exist and the model fits on them. probe=False (`sweep --dry-run --no-probe`): the
    interpreter is not run, and the sglang/vllm launches are shown without a command."""
    engine, sweep = recipe.engine, recipe.sweep
    profile = f"builtin-{engine.device}" if engine.kind == "builtin" else engine.kind
    rate = stream_tok_s or ASSUMED_STREAM_TOK_S[profile]
    start_s = ASSUMED_START_S[profile]
    specs = _specs(recipe)
    cache_dir = str(cache_dir) if cache_dir is not None else None
    warnings = []
    for c in sweep.concurrency:
        if sweep.num_prompts < 5 * c:
            warnings.append(f"num_prompts {sweep.num_prompts} < 5 x concurrency {c}: "
                            "too few requests to keep the server at that concurrency; figures will be noisy")
    for name in sweep.dataset:
        try:
            resolve_dataset(name)
        except DatasetNotFound as exc:
            # check_datasets refuses it before a sweep starts; a dry run with --no-probe (which does
            # not check this machine) gets here, or a resumed run whose file went away
            warnings.append(f"sweep.dataset {name!r} is not on this machine ({exc}); "
                            "the machine that runs the sweep needs it")
        except DatasetError as exc:
            warnings.append(f"dataset: {exc}")
    no_engine = None
    if engine.kind != "builtin" and caps is None and not probe:
        no_engine = f"not probed (--no-probe): {engine.kind}'s flags are unknown, so no launch command"
        warnings.append(no_engine)
    elif engine.kind != "builtin" and caps is None:
        try:
            caps = probe_engine(engine.kind, engine.python or sys.executable, cache_dir=cache_dir)
        except EngineError as exc:
            no_engine = str(exc)
            warnings.append(no_engine)
    if engine.kind != "builtin" and engine.gpus and hardware is not None and not hardware.gpus:
        warnings.append(f"GPUs not checked: {hardware.reason or 'none seen on this machine'}")

    # Server settings: (tp, gpus) always; the spec too when the engine fixes it at launch.
    settings = []
    for tp, gpus, pool in _gpu_sets(recipe):
        if engine.per_request_spec:
            settings.append((tp, gpus, pool, None))
        else:
            settings.extend((tp, gpus, pool, spec) for spec in specs)

    launches, points = [], []
    for tp, gpus, pool, fixed in settings:
        if fixed is None:
            algorithm = "ddtree" if "ddtree" in recipe.algorithms else recipe.algorithms[0]
            budgets = [b for b in recipe.budgets if b is not None]
            budget = max(budgets) if budgets and algorithm == "ddtree" else None
            run_specs = specs
        else:
            algorithm, budget = fixed[0], fixed[1]
            run_specs = [fixed]
        if engine.kind == "builtin":
            refused = builtin_refusal(recipe, [(algorithm, budget)] + [(a, b) for a, b, _ in run_specs])
            launch = Launch(index=len(launches), tp=tp, gpus=gpus, algorithm=algorithm, budget=budget,
                            argv=None if refused else _builtin_argv(recipe, algorithm, budget),
                            env=_env(recipe, gpus), est_start_s=start_s, unsupported=refused)
        else:
            launch = _engine_launch(recipe, len(launches), tp, gpus, pool, algorithm, budget, start_s,
                                    caps=caps, cache_dir=cache_dir, hardware=hardware, no_engine=no_engine)
        launches.append(launch)
        for dataset, temperature, concurrency in itertools.product(sweep.dataset, sweep.temperature,
                                                                  sorted(sweep.concurrency)):
            waves = math.ceil(sweep.num_prompts / concurrency) + (1 if sweep.warmup else 0)
            est = waves * sweep.max_new_tokens / rate
            if sweep.request_rate is not None:
                est = max(est, sweep.num_prompts / sweep.request_rate)
            for (spec_alg, spec_budget, is_baseline), repeat in _order(run_specs, sweep.repeats, sweep.interleave):
                points.append(PlanPoint(
                    index=len(points), launch=launch.index, engine_kind=engine.kind, algorithm=spec_alg,
                    budget=spec_budget, tp=tp, gpus=gpus, concurrency=concurrency, dataset=dataset,
                    temperature=float(temperature), repeat=repeat, baseline=is_baseline, est_s=est))
    reasons = sorted({l.unsupported for l in launches if l.unsupported and l.unsupported != no_engine})
    warnings.extend(f"unsupported launch: {r}" for r in reasons)
    total = sum(l.est_start_s for l in launches) + sum(p.est_s for p in points)
    return Plan(recipe=recipe, launches=tuple(launches), points=tuple(points), warnings=tuple(warnings),
                assumed_stream_tok_s=rate, est_total_s=total, caps=caps, cache_dir=cache_dir)


def _order(specs: list, repeats: int, interleave: bool) -> list[tuple]:
    """(spec, repeat) in run order: A B C A B C when interleaved, so drift in the machine's load
    (another job starting, clocks settling) lands on every spec alike and paired repeats (repeat i
    of a point with repeat i of its baseline) ran side by side; A A B B C C otherwise."""
    if interleave:
        return [(spec, r) for r in range(repeats) for spec in specs]
    return [(spec, r) for spec in specs for r in range(repeats)]


def repeat_note(recipe: Recipe) -> str:
    """What the plan says about repeats, their order and the warm-up."""
    sweep = recipe.sweep
    warm = (f"warm-up: {plural(sweep.warmup, 'request')} before each point, not measured" if sweep.warmup
            else "no warm-up")
    if sweep.repeats == 1:
        return f"repeats: 1 per point (no interval: a best budget cannot be told from noise; set sweep.repeats >= 3); {warm}"
    if not sweep.interleave:
        order = "each point's repeats back to back (sweep.interleave = false)"
    elif recipe.engine.per_request_spec:
        order = "interleaved across algorithms and budgets (A B C A B C) at each concurrency"
    else:
        order = "interleaved within each engine launch; this engine fixes the spec at launch, so a launch's repeats run together"
    return f"repeats: {sweep.repeats} per point, {order}; {warm}"


def _engine_launch(recipe: Recipe, index: int, tp: int, gpus: tuple[int, ...], pool: tuple[int, ...],
                   algorithm: str, budget: int | None, start_s: float, *, caps: Capabilities | None,
                   cache_dir: str | None, hardware: Hardware | None, no_engine: str | None) -> Launch:
    """An sglang/vllm launch: built from the probed capabilities, or marked unsupported with why."""
    budget = budget if algorithm == "ddtree" else None
    base = dict(index=index, tp=tp, gpus=gpus, algorithm=algorithm, budget=budget, kind=recipe.engine.kind,
                est_start_s=start_s)
    if no_engine is not None:
        return Launch(**base, argv=None, env=_env(recipe, gpus), unsupported=no_engine)
    try:
        known = [g.index for g in hardware.gpus] if hardware is not None and hardware.gpus else None
        check_gpus(pool, tp, visible=known)
        nodes, cpus, notes = _placement(recipe, gpus, hardware)
        spec = _engine_spec(recipe, algorithm, budget, tp, gpus, port=free_port(), caps=caps, cache_dir=cache_dir,
                            numa_nodes=nodes, numa_cpus=cpus)
        _fit(recipe, tp, gpus, hardware)
    except EngineError as exc:
        return Launch(**base, argv=None, env=_env(recipe, gpus), unsupported=str(exc))
    return Launch(**base, argv=spec.argv, env=tuple(sorted(spec.env.items())), command=spec.command_line(),
                  numa=spec.numa, numa_nodes=tuple(nodes), numa_cpus=tuple(cpus), cpu_affinity=spec.cpu_affinity,
                  notes=tuple(notes) + spec.notes)


BOX_WINDOW_S = 0.2  # how long the dry run watches the machine


def box_check(gpus: tuple[int, ...] = (), window_s: float = BOX_WINDOW_S) -> dict:
    """Is this machine busy right now? Everything but this process counts as other work (nothing
    of the sweep runs yet). The same judgement as each point's (engine/contention.busy_reasons)."""
    from ddtree.engine.machine.contention import box_now, busy_note, busy_reasons

    reading = box_now(window_s, gpus=gpus)
    reasons = busy_reasons(reading)
    cpu = "-" if reading.cpu_percent is None else f"{reading.cpu_percent:.0f}%"
    load = "-" if reading.load1 is None else f"{reading.load1:.2f}"
    quiet = f"the box is quiet now (load {load} on {reading.cpus} CPUs, CPU use {cpu})"
    return {"busy": bool(reasons), "note": busy_note(reasons) or quiet, "reasons": reasons,
            "load1": reading.load1, "cpus": reading.cpus, "cpu_percent": reading.cpu_percent,
            "others_cores": reading.others_cores,
            "gpu_reason": reading.gpu_reason if gpus else "no GPU in this plan"}


def box_line(box: dict) -> str:
    """The dry run's line about the machine: a warning when it is busy."""
    if box.get("busy"):
        return (f"warning: {box['note']}: the figures of points measured like this are noise; each point "
                "records what competed with it and is flagged contended")
    return f"box: {box['note']}"


def format_plan(plan: Plan) -> str:
    """The human-readable dry run."""
    lines = [f"sweep {plan.recipe.name!r}: {plural(len(plan.launches), 'engine launch', 'engine launches')}, "
             f"{plural(len(plan.points), 'point')}, "
             f"about {duration(plan.est_total_s)} (assuming {plan.assumed_stream_tok_s:g} tok/s per stream)"]
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    lines.append(box_line(plan.box))
    lines.append(repeat_note(plan.recipe))
    if plan.caps is not None:
        lines.append(f"engine: {plan.caps.label} at {plan.caps.python}")
    for launch in plan.launches:
        lines.append("")
        if launch.unsupported is not None:
            command = f"<unsupported: {launch.unsupported}>"
        elif launch.command is not None:
            command = launch.command
        else:
            env = " ".join(f"{k}={v}" for k, v in launch.env)
            command = f"{env} {' '.join(launch.argv)}"
        lines.append(f"launch {launch.index}: tp={launch.tp} gpus={list(launch.gpus) or '-'}  {command}".rstrip())
        lines.extend(f"  note: {note}" for note in launch.notes)
        for p in plan.points:
            if p.launch != launch.index:
                continue
            budget = "-" if p.budget is None else p.budget
            tag = "  (baseline)" if p.baseline else ""
            lines.append(f"  point {p.index:3d}: {p.algorithm:6s} budget={budget!s:>4} c={p.concurrency:<3d} "
                         f"T={p.temperature:g} {p.dataset} r{p.repeat}  ~{duration(p.est_s)}{tag}")
    return "\n".join(lines)
