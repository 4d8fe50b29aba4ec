"""The regression sentinel: a run's points against the history of runs that share its fingerprint.

Two runs share a fingerprint when they ran the same target model with the same drafter on the
same engine at the same engine version on the same physical hardware (GPU models, memory and
links, CPU model, cores, memory). Driver and library versions are left out ON PURPOSE: a driver
update is one of the things the sentinel must catch, so it cannot split the history; what changed
since the last run is reported next to a flag as its likely cause.

Each grid cell of the run (algorithm, budget, concurrency, TP, dataset, temperature, tokens) is
compared with the same cell in the last `last` earlier runs of its fingerprint. With two or more
earlier runs the historical interval is a 95% prediction interval from their per-run medians (the
spread between runs, floored at `SD_FLOOR` of the mean so a history that happened to agree to
the digit does not flag a wobble); with one, it is the two-sample interval from both runs'
repeats. A cell is flagged when its median falls below that interval AND by at least
`min_change` (5%): "18% slower than the last 5 runs", "tau collapsed at budget >= 32". A cell
with no interval (single repeats, one earlier run) is counted as unchecked, never flagged.

`sentinel(...)` is pure; `history_for` / `check_run` / `check_runs` read the store.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ddtree.store import stats
from ddtree.store.insight import budget_span
from ddtree.store.summary import BASELINE_NAMES, setting_label

#: Earlier runs of the fingerprint a cell is compared with (the most recent ones).
SENTINEL_RUNS = 5
#: A change smaller than this share of the historical mean is never flagged, however tight the history.
MIN_CHANGE = 0.05
#: The least spread (share of the mean) assumed between runs of one fingerprint.
SD_FLOOR = 0.02
#: Software whose version change is reported as a likely cause next to a flag.
CAUSE_PACKAGES = ("ddtree-console", "torch", "transformers", "sglang", "vllm", "flashinfer-python")
METRICS = ("throughput", "tau")


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _packages(software: Any) -> dict:
    sw = _dict(software)
    engine = _dict(sw.get("engine_python")).get("packages")
    return {**_dict(sw.get("packages")), **_dict(engine)}


def engine_version(run) -> str | None:
    """The version of the engine that served the run: sglang's or vllm's (from the engine's own
    interpreter when it had one), ddtree-console's for the builtin engine."""
    kind = run.engine_kind or "builtin"
    package = kind if kind in ("sglang", "vllm") else "ddtree-console"
    version = _packages(run.software).get(package)
    return f"{package} {version}" if version else None


def hardware_identity(hardware: Any) -> str | None:
    """The physical part of a run's hardware fingerprint (no driver version, no host name)."""
    hw = _dict(hardware)
    if not hw:
        return None
    host = _dict(hw.get("host"))
    gpus = [{k: _dict(g).get(k) for k in ("name", "memory_total", "nvlinks", "pcie_gen_max", "pcie_width_max")}
            for g in hw.get("gpus") or []]
    return json.dumps({"gpus": gpus, "links": hw.get("links"), "cpu": host.get("cpu_model"),
                       "cpus": host.get("cpus_logical"), "memory": host.get("memory_total")}, sort_keys=True)


@dataclass(frozen=True)
class Fingerprint:
    """What a run must share with earlier ones for the sentinel to compare them."""

    model: str | None
    draft_model: str | None
    engine_kind: str | None
    engine_version: str | None
    hardware: str | None  # hardware_identity()

    @property
    def key(self) -> str:
        return json.dumps([self.model, self.draft_model, self.engine_kind, self.engine_version, self.hardware])

    def to_dict(self) -> dict:
        return {"model": self.model, "draft_model": self.draft_model, "engine_kind": self.engine_kind,
                "engine_version": self.engine_version,
                "hardware": json.loads(self.hardware) if self.hardware else None}


def run_fingerprint(run) -> Fingerprint:
    recipe = _dict(run.recipe)
    engine = _dict(recipe.get("engine"))
    return Fingerprint(run.model or engine.get("model"), run.draft_model or engine.get("draft_model"),
                       run.engine_kind or engine.get("kind"), engine_version(run), hardware_identity(run.hardware))


def likely_causes(run, earlier) -> dict[str, list]:
    """{what: [before, now]} for the driver and the CAUSE_PACKAGES that changed since `earlier`."""
    out: dict[str, list] = {}
    now_hw, then_hw = _dict(run.hardware), _dict(earlier.hardware)
    for key in ("driver_version", "cuda_driver_version"):
        if now_hw.get(key) != then_hw.get(key) and (now_hw.get(key) or then_hw.get(key)):
            out[key.replace("_version", "")] = [then_hw.get(key), now_hw.get(key)]
    now_pk, then_pk = _packages(run.software), _packages(earlier.software)
    for name in CAUSE_PACKAGES:
        if now_pk.get(name) != then_pk.get(name) and (now_pk.get(name) or then_pk.get(name)):
            out[name] = [then_pk.get(name), now_pk.get(name)]
    return out


# -- cells ---------------------------------------------------------------------------------------


def tau_of(p) -> float | None:
    return p.tau_weighted if p.tau_weighted is not None else p.tau_mean


def _cell(p) -> tuple:
    return (p.algorithm, p.budget, p.tp, p.concurrency, p.dataset, p.temperature, getattr(p, "max_new_tokens", None))


def _values(points, metric: str) -> list[float]:
    get = (lambda p: p.output_tok_s) if metric == "throughput" else tau_of
    return [v for v in (get(p) for p in points) if v is not None]


def _by_cell(points) -> dict[tuple, list]:
    out: dict[tuple, list] = defaultdict(list)
    for p in points:
        if p.state == "done" and p.output_tok_s is not None:
            out[_cell(p)].append(p)
    return out


@dataclass(frozen=True)
class PointFlag:
    """One cell of the run that fell below its historical interval."""

    metric: str  # "throughput" | "tau"
    algorithm: str
    budget: int | None
    concurrency: int | None
    tp: int | None
    value: float  # the run's median
    mean: float  # the history's
    low: float  # the historical interval
    high: float
    change_pct: float  # (value - mean) / mean * 100, negative
    runs: tuple = ()  # the earlier runs compared with, newest first
    dataset: str | None = None
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}")

    def to_dict(self) -> dict:
        return {name: (list(v) if isinstance(v, tuple) else v)
                for name, v in ((n, getattr(self, n)) for n in self.__dataclass_fields__)}


def _against(n: int) -> str:
    return "the last run" if n == 1 else f"the last {n} runs"


def _interval(history: list[list[float]], m: int) -> tuple[float, float, float] | None:
    """(mean, low, high) of where the run's median of `m` repeats is expected, from the earlier
    runs' values (one list per run); None when there is no spread to judge by."""
    medians = [stats.summary(v).median for v in history if v]
    if len(medians) >= 2:
        s = stats.summary(medians)
        sd = max(s.sd or 0.0, SD_FLOOR * abs(s.mean))
        half = stats.t975(s.n - 1) * sd * math.sqrt(1 + 1 / s.n)
        return s.mean, s.mean - half, s.mean + half
    if len(medians) == 1 and len(history[0]) >= 2 and m >= 2:
        s = stats.summary(history[0])
        sd = max(s.sd or 0.0, SD_FLOOR * abs(s.mean))
        half = stats.t975(s.n - 1) * sd * math.sqrt(1 / s.n + 1 / m)
        return s.mean, s.mean - half, s.mean + half
    return None


@dataclass(frozen=True)
class SentinelReport:
    run_id: int
    fingerprint: Fingerprint
    history: tuple = ()  # ids of the earlier runs of the fingerprint compared with, newest first
    flags: tuple = ()  # PointFlag
    checked: int = 0  # cell-metrics with a historical interval
    unchecked: int = 0  # cell-metrics of the run that had history but no interval
    causes: dict = field(default_factory=dict)  # what changed since the newest earlier run
    tau_checked: dict = field(default_factory=dict)  # (c, tp, dataset, T) -> DDTree budgets with a tau interval

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    @property
    def lines(self) -> list[str]:
        return flag_lines(self.flags, self.causes, self.tau_checked)

    @property
    def short(self) -> str:
        """A table cell: "" (nothing to say), "ok vs 5" (checked against 5 runs, nothing fell),
        "⚠ c=4: tau collapsed at budget >= 32 (+1)" (the first flag, how many more lines)."""
        if not self.history or not (self.flags or self.checked):
            return ""
        if not self.flags:
            return f"ok vs {len(self.history)}"
        lines = [line for line in self.lines if not line.startswith("changed since")]
        more = f" (+{len(lines) - 1})" if len(lines) > 1 else ""
        return "⚠ " + lines[0].split(" (", 1)[0] + more

    @property
    def summary_text(self) -> str:
        if not self.history:
            return "no earlier run shares this run's fingerprint (model, drafter, engine version, hardware)"
        runs = ", ".join(str(r) for r in self.history)
        if not self.flags:
            extra = f" ({self.unchecked} without an interval: more repeats or runs needed)" if self.unchecked else ""
            return f"against runs {runs}: {self.checked} figures within their history{extra}"
        return f"against runs {runs}: {len(self.flags)} " + ("figure" if len(self.flags) == 1 else "figures") + " below their history"

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "fingerprint": self.fingerprint.to_dict(), "history": list(self.history),
                "checked": self.checked, "unchecked": self.unchecked, "flagged": self.flagged,
                "flags": [f.to_dict() for f in self.flags], "lines": self.lines, "causes": self.causes,
                "summary": self.summary_text}


def sentinel(run, points: list, history: list[tuple[Any, list]], *, last: int = SENTINEL_RUNS,
             min_change: float = MIN_CHANGE) -> SentinelReport:
    """`run`'s points against `history`: (earlier run, its points) pairs of the same fingerprint,
    any order; runs after `run` are ignored (the newest `last` earlier ones that hold a cell are used
    for it)."""
    fp = run_fingerprint(run)
    earlier = sorted(((r, pts) for r, pts in history if r.id < run.id and run_fingerprint(r).key == fp.key),
                     key=lambda item: -item[0].id)
    mine = _by_cell(points)
    past = [(r.id, _by_cell(pts)) for r, pts in earlier]
    flags, used = [], set()
    tau_checked: dict[tuple, list] = defaultdict(list)
    checked = unchecked = 0
    for cell, group in mine.items():
        algorithm, budget, tp, concurrency, dataset, temperature, _tokens = cell
        holders = [(rid, cells[cell]) for rid, cells in past if cell in cells][:last]
        if not holders:
            continue
        for metric in METRICS:
            if metric == "tau" and algorithm == "ar":
                continue  # plain decoding accepts one token a round by definition
            now = _values(group, metric)
            before = [_values(pts, metric) for _, pts in holders]
            before = [v for v in before if v]
            if not now or not before:
                continue
            band = _interval(before, len(now))
            if band is None:
                unchecked += 1
                continue
            checked += 1
            if metric == "tau" and algorithm == "ddtree":
                tau_checked[(concurrency, tp, dataset, temperature)].append(budget)
            used.update(rid for rid, _ in holders)
            mean, low, high = band
            value = stats.summary(now).median
            change = (value - mean) / mean if mean else 0.0
            if value < low and change <= -min_change:
                flags.append(PointFlag(metric, algorithm, budget, concurrency, tp, value, mean, low, high,
                                       change * 100, tuple(rid for rid, _ in holders), dataset, temperature))
    causes = likely_causes(run, earlier[0][0]) if earlier and flags else {}
    kept = tuple(r.id for r, _ in earlier if r.id in used) or tuple(r.id for r, _ in earlier[:last])
    return SentinelReport(run.id, fp, kept, tuple(flags), checked, unchecked, causes,
                          {k: tuple(sorted(v)) for k, v in tau_checked.items()})


def _setting_name(f: PointFlag) -> str:
    return setting_label({"concurrency": f.concurrency, "tp": f.tp}, {"concurrency", "tp"} if (f.tp or 1) > 1
                         else {"concurrency"})


def flag_lines(flags, causes: dict | None = None, checked: dict | None = None) -> list[str]:
    """Sentences for the flags, grouped by setting, metric and algorithm: "c=4: tau collapsed at
    budget >= 32 (4.4 -> 2.1 at 64, against the last 5 runs)", "c=1: budget 16 18% slower than
    the last 5 runs (61.0 vs 74.4 [71.2-77.6] tok/s)". `checked` maps a setting (concurrency, tp,
    dataset, temperature) to the DDTree budgets whose tau had an interval, so "collapsed at budget
    >= 32" is said only when every checked budget from 32 up fell."""
    groups: dict[tuple, list[PointFlag]] = defaultdict(list)
    for f in flags:
        groups[(f.concurrency, f.tp, f.dataset, f.temperature, f.metric, f.algorithm)].append(f)
    lines = []
    # DDTree before the baselines, tau before throughput (a collapse explains a slowdown).
    order = sorted(groups, key=lambda k: (str(k[:4]), k[5] != "ddtree", k[4] != "tau"))
    for key in order:
        (_c, _tp, _ds, _t, metric, algorithm), group = key, groups[key]
        group.sort(key=lambda f: (f.budget is None, f.budget or 0))
        where = _setting_name(group[0])
        n = max(len(f.runs) for f in group)
        worst = min(group, key=lambda f: f.change_pct)
        if algorithm != "ddtree":
            what = BASELINE_NAMES.get(algorithm, algorithm)
        elif len(group) == 1:
            what = f"budget {group[0].budget}"
        else:
            what = f"budgets {budget_span([f.budget for f in group], [f.budget for f in group])}"
        if metric == "tau":
            text = f"{what} tau fell {-worst.change_pct:.0f}%"
            if algorithm == "ddtree":
                known = (checked or {}).get((_c, _tp, _ds, _t), ())
                text = _tau_text(group, what, worst, list(known))
            detail = f"{worst.mean:.2f} -> {worst.value:.2f}"
            if worst.budget is not None:
                detail += f" at budget {worst.budget}"
            lines.append(f"{where}: {text} ({detail}, against {_against(n)})")
        else:
            pct = f"{-worst.change_pct:.0f}%"
            if len(group) > 1:
                best = max(group, key=lambda f: f.change_pct)
                if round(-best.change_pct) != round(-worst.change_pct):
                    pct = f"{-best.change_pct:.0f}-{-worst.change_pct:.0f}%"
            lines.append(f"{where}: {what} {pct} slower than {_against(n)} ({worst.value:.1f} vs "
                         f"{worst.mean:.1f} [{worst.low:.1f}-{worst.high:.1f}] tok/s)")
    if lines and causes:
        lines.append("changed since the last run: " + ", ".join(f"{k} {a or '-'} -> {b or '-'}"
                                                                for k, (a, b) in causes.items()))
    return lines


def _tau_text(group: list[PointFlag], what: str, worst: PointFlag, known: list) -> str:
    # "Collapsed" when the flagged budgets are every checked budget from some size up, and not all
    # of them: acceptance that stops growing with the tree (a hybrid target, a broken drafter).
    budgets = sorted(f.budget for f in group)
    known = sorted(set(known) | set(budgets))
    start = known.index(budgets[0])
    if budgets == known[start:] and start > 0:
        return f"tau collapsed at budget >= {budgets[0]}"
    if budgets == known and len(known) > 1:
        return f"tau fell at every budget, by up to {-worst.change_pct:.0f}%"
    return f"{what} tau fell {-worst.change_pct:.0f}%"


# -- reading the history from the store ----------------------------------------------------------


def _candidates(db, run, *, before: int | None = None, scan: int = 200) -> list:
    """Earlier runs with the same model, drafter and engine kind (the cheap columns), newest first."""
    from ddtree.store.queries import fetch_rows
    from ddtree.store.records import Run, from_row

    rows = fetch_rows(db, "SELECT * FROM runs WHERE model IS ? AND draft_model IS ? AND engine_kind IS ? AND id < ? "
                          "ORDER BY id DESC LIMIT ?",
                      [run.model, run.draft_model, run.engine_kind, before or run.id, int(scan)])
    return [from_row(Run, row) for row in rows]


def _points_of(db, run_ids) -> dict[int, list]:
    from ddtree.store.queries import fetch_rows
    from ddtree.store.records import from_row
    from ddtree.store.sweeps import Point

    ids = sorted(set(run_ids))
    out: dict[int, list] = {i: [] for i in ids}
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        rows = fetch_rows(db, f"SELECT * FROM points WHERE state = 'done' AND run_id IN "
                              f"({', '.join('?' for _ in chunk)}) ORDER BY run_id, coalesce(idx, id), id", chunk)
        for row in rows:
            out[row["run_id"]].append(from_row(Point, row))
    return out


def history_for(db, run, *, last: int = SENTINEL_RUNS) -> list[tuple[Any, list]]:
    """The earlier runs of `run`'s fingerprint that have done points (at most `last` per cell are
    used, so a few more are read), newest first, with their done points."""
    key = run_fingerprint(run).key
    same = [r for r in _candidates(db, run) if run_fingerprint(r).key == key]
    points = _points_of(db, [r.id for r in same[:4 * last]])
    return [(r, points[r.id]) for r in same[:4 * last] if points.get(r.id)]


def check_run(db, run, points: list | None = None, *, last: int = SENTINEL_RUNS,
              min_change: float = MIN_CHANGE) -> SentinelReport:
    """The sentinel for one stored run (its points read when not given)."""
    if points is None:
        points = _points_of(db, [run.id])[run.id]
    return sentinel(run, points, history_for(db, run, last=last), last=last, min_change=min_change)


def check_runs(db, run_ids, *, last: int = SENTINEL_RUNS) -> dict[int, SentinelReport]:
    """The sentinel for many runs at once (a History page): one scan of candidates per model
    triple and one read of points for all of them."""
    from ddtree.store.queries import get_run
    from ddtree.store.errors import NotFound

    runs = []
    for rid in run_ids:
        try:
            runs.append(get_run(db, rid))
        except NotFound:
            continue
    by_triple: dict[tuple, list] = defaultdict(list)
    for r in runs:
        by_triple[(r.model, r.draft_model, r.engine_kind)].append(r)
    histories: dict[int, list] = {}
    needed: set[int] = {r.id for r in runs}
    for group in by_triple.values():
        newest = max(group, key=lambda r: r.id)
        pool = [newest, *_candidates(db, newest, before=newest.id, scan=400)]
        seen = {p.id for p in pool}
        pool = sorted([*pool, *(r for r in group if r.id not in seen)], key=lambda r: -r.id)
        for r in group:
            key = run_fingerprint(r).key
            same = [c for c in pool if c.id < r.id and run_fingerprint(c).key == key][:4 * last]
            histories[r.id] = same
            needed.update(c.id for c in same)
    points = _points_of(db, needed)
    return {r.id: sentinel(r, points.get(r.id, []), [(c, points.get(c.id, [])) for c in histories[r.id]],
                           last=last) for r in runs}
