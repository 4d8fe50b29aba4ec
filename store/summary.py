"""A run's points summarised per grid cell, and the best-budget verdict per server/client setting.

The one place that says which budget is best: `runs`, every export and the console's Sweeps pane
read `best_budgets` (or `series_verdict` for the points of one curve), so they cannot disagree.

A grid cell is a point less its repeat. A setting is a cell less its algorithm and budget (engine
kind, tp, GPUs, concurrency, dataset, temperature): the budgets of one setting compete, and its
AR/DFlash points are the baselines for their paired ratios (repeat i against repeat i).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ddtree.store import stats
from ddtree.store.stats import UNSTABLE_CV, Ratio, Verdict

BASELINES = ("ar", "dflash")
BASELINE_NAMES = {"ar": "AR", "dflash": "DFlash"}
#: Figures summarised by their median over a cell's done repeats (the per-point columns).
MEDIAN_COLUMNS = ("output_tok_s", "req_s", "tok_s_per_user", "tau_mean", "tau_weighted", "tau_counters",
                  "ttft_p50", "itl_p50", "e2e_p50", "e2e_p99")
#: What a baseline must share with a point to be compared with it (points columns).
SETTING_NAMES = ("engine_kind", "tp", "gpus", "concurrency", "dataset", "temperature")
#: A grid cell: a setting, an algorithm and a budget (store.queries groups its SQL by these too).
CELL_FIELDS = (*SETTING_NAMES, "algorithm", "budget")


def setting_of(p) -> tuple:
    """What a baseline must share with a point to be compared with it (SETTING_NAMES' values)."""
    return tuple(json.dumps(p.gpus or []) if f == "gpus" else getattr(p, f) for f in SETTING_NAMES)


def cell_of(p) -> tuple:
    return (*setting_of(p), p.algorithm, p.budget)


def _done(points) -> list:
    return [p for p in points if p.state == "done" and p.output_tok_s is not None]


def _by_repeat(points) -> dict[int, float]:
    return {(p.repeat or 0): p.output_tok_s for p in points}


def _baselines(points) -> dict[tuple, dict[int, float]]:
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for p in _done(points):
        if p.algorithm in BASELINES:
            out[(setting_of(p), p.algorithm)][p.repeat or 0] = p.output_tok_s
    return out


def _median(values) -> float | None:
    return stats.summary(values).median


def cell_rows(points: list, *, unstable_cv: float = UNSTABLE_CV) -> list[dict]:
    """One row per grid cell, in run order: medians of the per-point figures over the done repeats,
    the summary of output tok/s (`output_tok_s_stats`: n, median, mean, sd, 95% CI, CV), the ratios
    to the baselines from paired repeats (`vs_ar`, `vs_dflash`: value, n, CI), `unstable` when the
    CV is above `unstable_cv`."""
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault(cell_of(p), []).append(p)
    base = _baselines(points)
    out = []
    for group in groups.values():
        done = _done(group)
        first = group[0]
        row: dict[str, Any] = {"algorithm": first.algorithm, "budget": first.budget, "tp": first.tp,
                               "gpus": first.gpus, "concurrency": first.concurrency, "dataset": first.dataset,
                               "temperature": first.temperature, "repeats_done": len(done),
                               "repeats": len(group), "baseline": bool(first.baseline),
                               "states": sorted({p.state for p in group})}
        for col in MEDIAN_COLUMNS:
            row[col] = _median(getattr(p, col, None) for p in done)
        tok = stats.summary(p.output_tok_s for p in done)
        row["output_tok_s_stats"] = tok.to_dict()
        row["cv"] = tok.cv
        row["unstable"] = tok.cv is not None and tok.cv > unstable_cv
        row["repeat_spread"] = done[0].repeat_spread if done else None
        for alg in BASELINES:
            ref = base.get((setting_of(first), alg))
            ratio = stats.paired_ratio(_by_repeat(done), ref) if ref and done and first.algorithm != alg else None
            row[f"vs_{alg}"] = ratio.to_dict() if ratio is not None else None
            row[f"speedup_vs_{alg}"] = ratio.value if ratio is not None else None
        row["error"] = next((p.error for p in group if p.error), None)
        # repeats measured on a busy box (store/contention.py); None when none was measured
        measured = [p for p in group if getattr(p, "contended", None) is not None]
        row["contended"] = sum(bool(p.contended) for p in measured) if measured else None
        out.append(row)
    return out


@dataclass(frozen=True)
class BestBudget:
    """The verdict over the DDTree budgets of one setting, with the leader's paired ratios."""

    setting: dict
    verdict: Verdict
    ratios: dict = field(default_factory=dict)  # baseline algorithm -> Ratio of the leader
    leader: int | None = None

    @property
    def line(self) -> str:
        parts = []
        for alg, r in self.ratios.items():
            if r.value is None:
                continue
            ci = f" [{r.ci_low:.2f}-{r.ci_high:.2f}]" if r.ci_low is not None else ""
            parts.append(f"{r.value:.2f}x{ci} {BASELINE_NAMES[alg]}")
        text = self.verdict.text
        if parts:
            who = f"budget {self.leader}: " if self.verdict.state == "tie" else ""
            text += f" ({who}{', '.join(parts)})"
        return f"{text}; {self.verdict.note}" if self.verdict.note else text

    def to_dict(self) -> dict:
        return {"setting": self.setting, "leader": self.leader, **self.verdict.to_dict(),
                "ratios": {alg: r.to_dict() for alg, r in self.ratios.items()}, "line": self.line}


def series_verdict(points: list, *, unstable_cv: float = UNSTABLE_CV) -> BestBudget:
    """The verdict for the points of one setting (DDTree budgets compete; AR/DFlash are baselines)."""
    done = _done(points)
    cells: dict[int, list] = defaultdict(list)
    for p in done:
        if p.algorithm == "ddtree" and p.budget is not None:
            cells[p.budget].append(p)
    candidates = [(budget, stats.summary(p.output_tok_s for p in cells[budget])) for budget in sorted(cells)]
    v = stats.verdict(candidates, noun="budget", unit="tok/s", unstable_cv=unstable_cv)
    first = done[0] if done else (points[0] if points else None)
    setting = {name: getattr(first, name, None) for name in SETTING_NAMES} if first is not None else {}
    leader = v.best if v.best is not None else (v.tied[0] if v.tied else None)
    ratios: dict[str, Ratio] = {}
    if leader is not None:
        mine = _by_repeat(cells[leader])
        for alg in BASELINES:
            ref = _by_repeat([p for p in done if p.algorithm == alg])
            if ref:
                ratios[alg] = stats.paired_ratio(mine, ref)
    return BestBudget(setting=setting, verdict=v, ratios=ratios, leader=leader)


def best_budgets(points: list, *, unstable_cv: float = UNSTABLE_CV) -> list[BestBudget]:
    """One verdict per setting that has DDTree budgets, in run order."""
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault(setting_of(p), []).append(p)
    out = []
    for group in groups.values():
        if any(p.algorithm == "ddtree" and p.budget is not None for p in group):
            out.append(series_verdict(group, unstable_cv=unstable_cv))
    return out


def setting_label(setting: dict, varying: set[str] | None = None) -> str:
    """`c=4 tp=2 T=0.7 dataset` naming only the settings in `varying` (all when None)."""
    names = {"concurrency": "c=", "tp": "tp=", "temperature": "T=", "dataset": "", "gpus": "gpus=",
             "engine_kind": ""}
    keys = [k for k in ("concurrency", "tp", "gpus", "dataset", "temperature") if varying is None or k in varying]
    parts = []
    for k in keys:
        value = setting.get(k)
        parts.append(f"{names[k]}{value:g}" if isinstance(value, float) else f"{names[k]}{value}")
    return " ".join(parts) or f"c={setting.get('concurrency')}"


def labelled(bests: list[BestBudget]) -> list[tuple[str, BestBudget]]:
    """(label naming what varies between the settings, verdict) pairs."""
    keys = ("concurrency", "tp", "gpus", "dataset", "temperature")
    varying = {k for k in keys if len({json.dumps(b.setting.get(k)) for b in bests}) > 1} or {"concurrency"}
    return [(setting_label(b.setting, varying), b) for b in bests]


def _match_key(row: dict) -> tuple:
    """What two runs' cells must share to be compared: the grid coordinates, not the machine."""
    return (row["algorithm"], row["budget"], row["tp"], row["concurrency"], row["dataset"], row["temperature"])


def compare_cells(base_points: list, other_points: list) -> list[dict]:
    """Per grid cell present in both runs: both output tok/s summaries, the change of the median
    in percent, and whether it is significant (both 95% intervals exist and do not overlap).

    `verdict` is "faster", "slower", "tie within noise" (the intervals overlap) or "untested"
    (a run has fewer than two repeats of the cell, so no interval)."""
    base = {_match_key(r): r for r in cell_rows(base_points)}
    out = []
    for row in cell_rows(other_points):
        ref = base.get(_match_key(row))
        if ref is None:
            continue
        a, b = ref["output_tok_s_stats"], row["output_tok_s_stats"]
        if a["median"] is None or b["median"] is None:
            continue
        delta = (b["median"] - a["median"]) / a["median"] * 100 if a["median"] else None
        tested = a["ci_low"] is not None and b["ci_low"] is not None
        apart = tested and (b["ci_low"] > a["ci_high"] or a["ci_low"] > b["ci_high"])
        if not tested:
            verdict = "untested"
        elif not apart:
            verdict = "tie within noise"
        else:
            verdict = "faster" if b["median"] > a["median"] else "slower"
        out.append({"algorithm": row["algorithm"], "budget": row["budget"], "concurrency": row["concurrency"],
                    "tp": row["tp"], "dataset": row["dataset"], "temperature": row["temperature"],
                    "base": a, "other": b, "delta_pct": delta, "significant": bool(apart), "verdict": verdict})
    return out
