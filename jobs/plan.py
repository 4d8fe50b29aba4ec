"""Expand a recipe into the ordered sweep plan: every engine launch and every point.

Server-side axes (tp, gpus, and algorithm/budget for engines that fix them at launch) give one
engine launch each; client-side axes (concurrency, dataset, temperature) and repeats reuse it.
The builtin engine takes the algorithm and budget per request, so for it those are client-side too.
Baselines (`sweep.baseline`) are measured at every server setting, before the measured algorithms,
so each point's speedup compares like with like.

`make_plan(recipe)` starts nothing; `Plan.to_dict()` is what `sweep --dry-run --json` prints.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.engine.errors import EngineError
from ddtree.jobs.errors import JobError
from ddtree.jobs.recipe import Recipe

# Assumed decode speed per request stream and engine start-up time, for the estimate only: the
# dry-run says they are assumptions, and the caller may pass a rate measured in an earlier run.
ASSUMED_STREAM_TOK_S = {"builtin-cpu": 60.0, "builtin-cuda": 40.0, "sglang": 80.0, "vllm": 80.0}
ASSUMED_START_S = {"builtin-cpu": 8.0, "builtin-cuda": 20.0, "sglang": 180.0, "vllm": 180.0}

SERVER_MODULE = "ddtree.engine.reference.server"


class UnsupportedEngine(JobError):
    """The recipe names an engine whose launch spec this version cannot build yet."""

    exit_code = 2


@dataclass(frozen=True)
class Launch:
    """One engine process: started when its first point comes up, stopped after its last."""

    index: int
    tp: int
    gpus: tuple[int, ...]
    algorithm: str
    budget: int | None
    argv: tuple[str, ...] | None
    env: tuple[tuple[str, str], ...]
    est_start_s: float
    unsupported: str | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "tp": self.tp, "gpus": list(self.gpus), "algorithm": self.algorithm,
                "budget": self.budget, "argv": list(self.argv) if self.argv is not None else None,
                "env": dict(self.env), "est_start_s": round(self.est_start_s, 1), "unsupported": self.unsupported}


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

    def to_dict(self) -> dict:
        return {
            "name": self.recipe.name,
            "engine_kind": self.recipe.engine.kind,
            "launches": [launch.to_dict() for launch in self.launches],
            "points": [point.to_dict() for point in self.points],
            "warnings": list(self.warnings),
            "estimate": {"total_s": round(self.est_total_s, 1), "stream_tok_s": self.assumed_stream_tok_s,
                         "note": "assumes this decode speed per request stream; not measured"},
        }

    def launch_of(self, point: PlanPoint) -> Launch:
        return self.launches[point.launch]


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


def _builtin_argv(recipe: Recipe, algorithm: str, budget: int | None) -> tuple[str, ...]:
    engine = recipe.engine
    model, draft = engine.model, engine.draft_model
    if model is None:
        demo_target, demo_drafter = demo_pair()
        model = demo_target
        draft = draft or demo_drafter
    argv = [engine.python or sys.executable, "-m", SERVER_MODULE, "--model", model]
    if draft is not None:
        argv += ["--draft", draft]
    argv += ["--algorithm", algorithm]
    if budget is not None:
        argv += ["--budget", str(budget)]
    if engine.block_size is not None:
        argv += ["--block-size", str(engine.block_size)]
    argv += ["--device", engine.device, "--host", "127.0.0.1", "--port", "0"]
    return tuple(argv)


def _specs(recipe: Recipe) -> list[tuple[str, int | None, bool]]:
    """(algorithm, budget, is_baseline) in run order: baselines first, then the measured grid."""
    measured = []
    for algorithm in recipe.algorithms:
        budgets = recipe.budgets if algorithm == "ddtree" else (None,)
        measured.extend((algorithm, budget, False) for budget in budgets)
    present = {(a, b) for a, b, _ in measured}
    baselines = [(b, None, True) for b in recipe.sweep.baseline if (b, None) not in present]
    return baselines + measured


def _gpu_sets(recipe: Recipe) -> list[tuple[int, tuple[int, ...]]]:
    sweep, engine = recipe.sweep, recipe.engine
    if sweep.gpus:
        return [(tp, gpus) for gpus in sweep.gpus for tp in sweep.tp]
    return [(tp, engine.gpus[:tp] if engine.gpus else ()) for tp in sweep.tp]


def _env(recipe: Recipe, gpus: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    env = dict(recipe.engine.env)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return tuple(sorted(env.items()))


def make_plan(recipe: Recipe, *, stream_tok_s: float | None = None) -> Plan:
    """The whole sweep in run order. `stream_tok_s` overrides the assumed decode speed."""
    engine, sweep = recipe.engine, recipe.sweep
    profile = f"builtin-{engine.device}" if engine.kind == "builtin" else engine.kind
    rate = stream_tok_s or ASSUMED_STREAM_TOK_S[profile]
    start_s = ASSUMED_START_S[profile]
    specs = _specs(recipe)
    warnings = []
    for c in sweep.concurrency:
        if sweep.num_prompts < 5 * c:
            warnings.append(f"num_prompts {sweep.num_prompts} < 5 x concurrency {c}: "
                            "too few requests to keep the server at that concurrency; figures will be noisy")
    unsupported = None
    if engine.kind != "builtin":
        unsupported = (f"launching {engine.kind} engines is not supported yet (the launch spec comes with the "
                       "SGLang/vLLM issue); use kind = \"builtin\"")
        warnings.append(unsupported)

    # Server settings: (tp, gpus) always; the spec too when the engine fixes it at launch.
    settings = []
    for tp, gpus in _gpu_sets(recipe):
        if engine.per_request_spec:
            settings.append((tp, gpus, None))
        else:
            settings.extend((tp, gpus, spec) for spec in specs)

    launches, points = [], []
    for tp, gpus, fixed in settings:
        if fixed is None:
            algorithm = "ddtree" if "ddtree" in recipe.algorithms else recipe.algorithms[0]
            budgets = [b for b in recipe.budgets if b is not None]
            budget = max(budgets) if budgets and algorithm == "ddtree" else None
            run_specs = specs
        else:
            algorithm, budget = fixed[0], fixed[1]
            run_specs = [fixed]
        argv = _builtin_argv(recipe, algorithm, budget) if engine.kind == "builtin" else None
        launch = Launch(index=len(launches), tp=tp, gpus=gpus, algorithm=algorithm, budget=budget, argv=argv,
                        env=_env(recipe, gpus), est_start_s=start_s, unsupported=unsupported)
        launches.append(launch)
        for dataset, temperature, concurrency in itertools.product(sweep.dataset, sweep.temperature,
                                                                  sorted(sweep.concurrency)):
            waves = math.ceil(sweep.num_prompts / concurrency) + (1 if sweep.warmup else 0)
            est = waves * sweep.max_new_tokens / rate
            if sweep.request_rate is not None:
                est = max(est, sweep.num_prompts / sweep.request_rate)
            for (spec_alg, spec_budget, is_baseline), repeat in itertools.product(run_specs, range(sweep.repeats)):
                points.append(PlanPoint(
                    index=len(points), launch=launch.index, engine_kind=engine.kind, algorithm=spec_alg,
                    budget=spec_budget, tp=tp, gpus=gpus, concurrency=concurrency, dataset=dataset,
                    temperature=float(temperature), repeat=repeat, baseline=is_baseline, est_s=est))
    total = sum(l.est_start_s for l in launches) + sum(p.est_s for p in points)
    return Plan(recipe=recipe, launches=tuple(launches), points=tuple(points), warnings=tuple(warnings),
                assumed_stream_tok_s=rate, est_total_s=total)


def format_plan(plan: Plan) -> str:
    """The human-readable dry run."""
    lines = [f"sweep {plan.recipe.name!r}: {len(plan.launches)} engine launch(es), {len(plan.points)} point(s), "
             f"about {_duration(plan.est_total_s)} (assuming {plan.assumed_stream_tok_s:g} tok/s per stream)"]
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    for launch in plan.launches:
        lines.append("")
        env = " ".join(f"{k}={v}" for k, v in launch.env)
        argv = " ".join(launch.argv) if launch.argv is not None else f"<{launch.unsupported}>"
        lines.append(f"launch {launch.index}: tp={launch.tp} gpus={list(launch.gpus) or '-'}  {env} {argv}".rstrip())
        for p in plan.points:
            if p.launch != launch.index:
                continue
            budget = "-" if p.budget is None else p.budget
            tag = "  (baseline)" if p.baseline else ""
            lines.append(f"  point {p.index:3d}: {p.algorithm:6s} budget={budget!s:>4} c={p.concurrency:<3d} "
                         f"T={p.temperature:g} {p.dataset} r{p.repeat}  ~{_duration(p.est_s)}{tag}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
