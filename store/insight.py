"""What a sweep says beyond its table: the budget to serve with, and where acceptance stops.

Pure functions over a run's points (store/sweeps.Point or anything with the same attributes), so
`runs`, the exports and the console's Sweeps pane read one answer.

- `recommend(points)`: per setting (concurrency, TP, ...), the budget to serve with: the SMALLEST
  DDTree budget whose output tok/s interval overlaps the best one's. A smaller tree costs less
  memory and drafting and is more robust, so among budgets the data cannot tell apart the smallest
  wins. The tie is settled only when the intervals are tight enough to show that no tied budget
  beats the recommended one by more than `margin` (5% by default); otherwise the answer is
  "budgets 16-64 tie; measure more repeats", with the repeats per cell that would settle it.
- `serving_settings(points)`: the recommendation as plain data for exports and recipes.
- `acceptance_grids(points)`: per setting, the share of verify rounds that accepted each length,
  per budget (the acceptance heatmap; console/widgets/heatmap.py draws it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ddtree.store import stats
from ddtree.store.stats import UNSTABLE_CV, Ratio, Summary
from ddtree.store.summary import BASELINE_NAMES, BASELINES, SETTING_NAMES, labelled, setting_of

#: Budgets whose throughput provably differs by less than this share of the best's mean are
#: equivalent: the smallest of them is served.
TIE_MARGIN = 0.05
#: Repeats a cell needs before it has an interval worth deciding on (two give one, but a wide one).
MIN_REPEATS = 3
#: The most repeats the recommender will ask for; past it more repeats are not the answer.
MAX_REPEATS = 30

STATES = ("clear", "tie", "undecided", "untested", "single", "none")
DECIDED = frozenset({"clear", "tie", "single"})


def _done(points) -> list:
    return [p for p in points if p.state == "done" and p.output_tok_s is not None]


def budget_span(budgets, measured) -> str:
    """"16-64" when `budgets` are consecutive among the `measured` ones, else "8, 32"."""
    chosen = sorted(set(budgets))
    order = sorted(set(measured))
    if len(chosen) > 2 and all(b in order for b in chosen):
        first = order.index(chosen[0])
        if order[first:first + len(chosen)] == chosen:
            return f"{chosen[0]}-{chosen[-1]}"
    return ", ".join(str(b) for b in chosen)


def _ratio_text(ratio: Ratio | None, name: str) -> str | None:
    if ratio is None or ratio.value is None:
        return None
    ci = f" [{ratio.ci_low:.2f}-{ratio.ci_high:.2f}]" if ratio.ci_low is not None else ""
    return f"{ratio.value:.2f}x{ci} {name}"


def _tok_text(s: Summary | None) -> str:
    if s is None or s.mean is None:
        return "-"
    if s.has_interval:
        return f"{s.mean:.1f} tok/s [{s.ci_low:.1f}-{s.ci_high:.1f}]"
    return f"{s.mean:.1f} tok/s (n={s.n})"


@dataclass(frozen=True)
class RepeatAsk:
    """More repeats of one grid cell that would help settle a recommendation."""

    budget: int
    have: int
    want: int
    cell_key: str | None = None  # the points' cell_key (store/sweeps.cell_key), to queue them
    algorithm: str = "ddtree"

    def __post_init__(self) -> None:
        if self.want < self.have or self.have < 0:
            raise ValueError(f"want ({self.want}) must be >= have ({self.have}) >= 0")

    @property
    def extra(self) -> int:
        return self.want - self.have

    def to_dict(self) -> dict:
        return {"algorithm": self.algorithm, "budget": self.budget, "have": self.have, "want": self.want,
                "extra": self.extra, "cell_key": self.cell_key}


@dataclass(frozen=True)
class Recommendation:
    """The budget to serve one setting with.

    state: "clear" (the best budget's interval is clear of every other), "tie" (several overlap
    the best, provably within `margin`: the smallest is served), "undecided" (they overlap but the
    intervals are too wide to tell: `more` lists the repeats that would tell), "untested" (a budget
    has fewer than two repeats: `budget` is merely the highest), "single" (one budget measured),
    "none" (no DDTree budget measured)."""

    setting: dict
    state: str
    budget: int | None = None  # the one to serve with (tentative unless `decided`)
    best: int | None = None  # the highest mean
    tied: tuple = ()  # budgets whose interval reaches the best's, smallest first
    measured: tuple = ()  # every DDTree budget with a done repeat
    throughput: Summary | None = None  # output tok/s of `budget` over its repeats
    ratios: dict = field(default_factory=dict)  # "ar"/"dflash" -> Ratio of `budget` (paired repeats)
    more: tuple = ()  # RepeatAsk, the cells to measure again
    margin: float = TIE_MARGIN

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"unknown recommendation state {self.state!r}")

    @property
    def decided(self) -> bool:
        return self.state in DECIDED

    def _gains(self) -> str:
        parts = [_ratio_text(self.ratios.get(alg), BASELINE_NAMES[alg]) for alg in BASELINES]
        return ", ".join(p for p in parts if p)

    def _asks(self) -> str:
        """"budgets 8, 32 to 6 repeats, 16 to 5": the repeats wanted, by how many."""
        by_want: dict[int, list] = defaultdict(list)
        for a in self.more:
            by_want[a.want].append(a.budget)
        parts = [f"{'budget' if len(b) == 1 else 'budgets'} {', '.join(map(str, b))} to {n}"
                 for n, b in sorted(by_want.items(), reverse=True)]
        return ", ".join(parts) + " repeats" if parts else ""

    @property
    def text(self) -> str:
        """The full sentence (runs, exports)."""
        gains = self._gains()
        tail = f"; {gains}" if gains else ""
        span = budget_span(self.tied, self.measured)
        if self.state == "none":
            return "no DDTree budget measured yet"
        if self.state == "single":
            return f"only budget {self.budget} measured: {_tok_text(self.throughput)}{tail}"
        if self.state == "clear":
            return f"serve budget {self.budget}: {_tok_text(self.throughput)}, clear of every other budget{tail}"
        if self.state == "tie":
            return (f"serve budget {self.budget}, the smallest of budgets {span} that tie within "
                    f"{self.margin:.0%}: {_tok_text(self.throughput)}{tail}")
        if self.state == "undecided":
            return (f"budgets {span} tie; measure more repeats ({self._asks()}); "
                    f"until then budget {self.budget}: {_tok_text(self.throughput)}{tail}")
        return (f"budget {self.best} is highest at {_tok_text(self.throughput)} but untested: "
                f"fewer than two repeats; measure {MIN_REPEATS} repeats of budgets "
                f"{budget_span([a.budget for a in self.more], self.measured)}{tail}")

    @property
    def line(self) -> str:
        """A short form for a pane: "serve budget 16 at 74.0 tok/s (3.36x AR); budgets 16-64 tie within 5%"."""
        if self.state == "none":
            return "no DDTree budget measured yet"
        s = self.throughput
        at = f" at {s.mean:.1f} tok/s" if s is not None and s.mean is not None else ""
        gains = self._gains()
        gains = f" ({gains})" if gains else ""
        span = budget_span(self.tied, self.measured)
        if self.state == "clear":
            return f"serve budget {self.budget}{at}{gains}; clear of the rest"
        if self.state == "tie":
            return f"serve budget {self.budget}{at}{gains}; budgets {span} tie within {self.margin:.0%}"
        if self.state == "single":
            return f"only budget {self.budget}{at}{gains}"
        if self.state == "undecided":
            return f"budgets {span} tie; measure more repeats ({self._asks()}); until then budget {self.budget}{at}{gains}"
        asked = budget_span([a.budget for a in self.more], self.measured)
        return f"highest budget {self.best}{at}, untested{gains}; measure {MIN_REPEATS} repeats of budgets {asked}"

    def to_dict(self) -> dict:
        return {"setting": self.setting, "state": self.state, "decided": self.decided, "budget": self.budget,
                "best": self.best, "tied": list(self.tied), "measured": list(self.measured),
                "output_tok_s": self.throughput.to_dict() if self.throughput is not None else None,
                "ratios": {alg: r.to_dict() for alg, r in self.ratios.items()},
                "more_repeats": [a.to_dict() for a in self.more], "margin": self.margin,
                "text": self.text, "line": self.line}


def _half(n: int, sd: float) -> float:
    return stats.t975(n - 1) * sd / math.sqrt(n)


def repeats_to_settle(a: Summary, b: Summary, scale: float, margin: float) -> int | None:
    """The repeats per cell after which the intervals of `a` (the recommended budget) and `b`
    (one that ties with it) are expected either to come apart or to show b within `margin` of a,
    if the means and spreads stay as measured; None past MAX_REPEATS.

    Apart: the half-widths sum below the gap d = mean_b - mean_a. Within the margin: the upper end
    of b stays below the lower end of a plus margin * scale, i.e. the half-widths sum below
    margin * scale - d. Whichever comes first settles it."""
    d = b.mean - a.mean
    room = max(d, margin * scale - d)
    if room <= 0:
        return None
    for n in range(max(a.n, b.n, 2), MAX_REPEATS + 1):
        if _half(n, a.sd or 0.0) + _half(n, b.sd or 0.0) < room:
            return n
    return None


def _paired(values: list, baseline: list) -> Ratio | None:
    ref = {(p.repeat or 0): p.output_tok_s for p in baseline}
    if not ref or not values:
        return None
    return stats.paired_ratio({(p.repeat or 0): p.output_tok_s for p in values}, ref)


def recommend_setting(points: list, *, margin: float = TIE_MARGIN) -> Recommendation:
    """The recommendation for the points of ONE setting (DDTree budgets compete; AR and DFlash
    points of the same setting are the baselines of the gains)."""
    done = _done(points)
    first = done[0] if done else (points[0] if points else None)
    setting = {name: getattr(first, name, None) for name in SETTING_NAMES} if first is not None else {}
    cells: dict[int, list] = defaultdict(list)
    for p in done:
        if p.algorithm == "ddtree" and p.budget is not None:
            cells[p.budget].append(p)
    if not cells:
        return Recommendation(setting, "none", margin=margin)
    sums = {b: stats.summary(p.output_tok_s for p in group) for b, group in cells.items()}
    measured = tuple(sorted(cells))
    best = max(measured, key=lambda b: (sums[b].mean, -b))

    def keyed(b: int) -> str | None:
        return next((p.cell_key for p in cells[b] if getattr(p, "cell_key", None)), None)

    def gains(b: int) -> dict:
        out = {}
        for alg in BASELINES:
            r = _paired(cells[b], [p for p in done if p.algorithm == alg])
            if r is not None:
                out[alg] = r
        return out

    base = dict(setting=setting, best=best, measured=measured, margin=margin)
    if len(measured) == 1:
        return Recommendation(state="single", budget=best, tied=(best,), throughput=sums[best], ratios=gains(best),
                              **base)
    short = [b for b in measured if sums[b].n < 2]
    if short:
        asks = tuple(RepeatAsk(b, sums[b].n, MIN_REPEATS, keyed(b)) for b in measured if sums[b].n < MIN_REPEATS)
        return Recommendation(state="untested", budget=best, tied=(best,), throughput=sums[best], ratios=gains(best),
                              more=asks, **base)
    top = sums[best]
    tied = tuple(b for b in measured if sums[b].ci_high >= top.ci_low)
    pick = tied[0]  # the smallest budget the data cannot tell from the best
    if tied == (best,):
        return Recommendation(state="clear", budget=best, tied=tied, throughput=top, ratios=gains(best), **base)
    chosen = sums[pick]
    scale = top.mean
    loose = [b for b in tied if b != pick and sums[b].ci_high - chosen.ci_low > margin * scale]
    if not loose:
        return Recommendation(state="tie", budget=pick, tied=tied, throughput=chosen, ratios=gains(pick), **base)
    want: dict[int, int] = {}
    for b in loose:
        n = repeats_to_settle(chosen, sums[b], scale, margin) or MAX_REPEATS
        for cell in (pick, b):
            want[cell] = max(want.get(cell, 0), n)
    asks = tuple(RepeatAsk(b, sums[b].n, max(n, sums[b].n), keyed(b)) for b, n in sorted(want.items())
                 if n > sums[b].n)
    return Recommendation(state="undecided", budget=pick, tied=tied, throughput=chosen, ratios=gains(pick),
                          more=asks, **base)


def recommend(points: list, *, margin: float = TIE_MARGIN) -> list[Recommendation]:
    """One recommendation per setting that has DDTree budgets, in run order."""
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault(setting_of(p), []).append(p)
    return [recommend_setting(group, margin=margin) for group in groups.values()
            if any(p.algorithm == "ddtree" and p.budget is not None and p.state == "done" for p in group)]


def labelled_recommendations(points: list, *, margin: float = TIE_MARGIN) -> list[tuple[str, Recommendation]]:
    """(label naming what varies between settings, e.g. "c=4", recommendation) pairs."""
    return labelled(recommend(points, margin=margin))  # type: ignore[arg-type]  # it reads .setting only


def serving_settings(points: list, *, margin: float = TIE_MARGIN) -> list[dict]:
    """The recommended serving setting per setting of the run, for exports and recipes: the
    setting's own coordinates, then `algorithm`/`budget` to serve with, whether the data decided
    it, the sentence, and the gains. Settings with nothing measured are left out."""
    out = []
    for label, rec in labelled_recommendations(points, margin=margin):
        if rec.budget is None:
            continue
        out.append({"label": label, **{k: rec.setting.get(k) for k in ("concurrency", "tp", "dataset", "temperature")},
                    "algorithm": "ddtree", "budget": rec.budget, "state": rec.state, "decided": rec.decided,
                    "text": rec.text,
                    "vs_ar": rec.ratios["ar"].to_dict() if "ar" in rec.ratios else None,
                    "vs_dflash": rec.ratios["dflash"].to_dict() if "dflash" in rec.ratios else None})
    return out


def serving_comment(points: list, *, margin: float = TIE_MARGIN) -> str:
    """Comment lines (without '#') naming the recommended serving setting, for a TOML recipe."""
    rows = serving_settings(points, margin=margin)
    if not rows:
        return "recommended serving setting: none yet (no DDTree budget measured)"
    lines = ["recommended serving setting (engine.algorithm = \"ddtree\", engine.budget = N):"]
    for row in rows:
        sure = "" if row["decided"] else " (not decided yet)"
        lines.append(f"  {row['label']}: budget = {row['budget']}{sure}: {row['text']}")
    return "\n".join(lines)


# -- the acceptance heatmap ----------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceRow:
    """One budget (or the DFlash chain): verify rounds by accepted length, over its done repeats."""

    label: str  # the budget, or "DFlash"
    budget: int | None
    rounds: int
    shares: tuple  # share of rounds per length in the grid's `lengths`
    mean: float | None  # mean accepted length per round (tau, bonus token included)

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")


@dataclass(frozen=True)
class AcceptanceGrid:
    """The heatmap of one setting: rows are budgets, columns accepted lengths per round."""

    setting: dict
    label: str
    lengths: tuple  # accepted lengths shown (tau = 1 .. the longest seen)
    rows: tuple  # AcceptanceRow, DFlash first, then budgets ascending

    def share(self, label: str, length: int) -> float:
        row = next(r for r in self.rows if r.label == label)
        return row.shares[self.lengths.index(length)]

    def to_dict(self) -> dict:
        return {"setting": self.setting, "label": self.label, "lengths": list(self.lengths),
                "rows": [{"label": r.label, "budget": r.budget, "rounds": r.rounds, "shares": list(r.shares),
                          "mean": r.mean} for r in self.rows]}


def merged_histogram(hists) -> list[int]:
    """Element-wise sum of accepted-length histograms (index = accepted length per round, the
    bonus token included; entries that are not counts are skipped)."""
    out: list[int] = []
    for h in hists:
        if not isinstance(h, (list, tuple)):
            continue
        if len(h) > len(out):
            out.extend([0] * (len(h) - len(out)))
        for i, n in enumerate(h):
            if isinstance(n, (int, float)) and n > 0:
                out[i] += int(n)
    return out


def acceptance_grids(points: list, *, dflash: bool = True) -> list[AcceptanceGrid]:
    """Per setting with a stored histogram (points' `tau_hist`, index = accepted length), the share
    of rounds at each accepted length per DDTree budget (and the DFlash chain when `dflash`)."""
    groups: dict[tuple, list] = {}
    for p in _done(points):
        if p.algorithm == "ddtree" and p.budget is not None or (dflash and p.algorithm == "dflash"):
            groups.setdefault(setting_of(p), []).append(p)
    grids = []
    for group in groups.values():
        by_row: dict[tuple, list] = defaultdict(list)
        for p in group:
            by_row[(0, -1) if p.algorithm == "dflash" else (1, p.budget)].append(p.tau_hist)
        hists = {key: merged_histogram(h) for key, h in sorted(by_row.items())}
        hists = {key: h for key, h in hists.items() if sum(h)}
        if not hists:
            continue
        top = max(max((i for i, n in enumerate(h) if n), default=0) for h in hists.values())
        low = 0 if any(h and h[0] for h in hists.values()) else 1
        lengths = tuple(range(low, max(top, low) + 1))
        rows = []
        for (kind, budget), h in hists.items():
            total = sum(h)
            counts = [h[i] if i < len(h) else 0 for i in lengths]
            mean = sum(i * n for i, n in enumerate(h)) / total
            rows.append(AcceptanceRow("DFlash" if kind == 0 else str(budget), None if kind == 0 else budget, total,
                                      tuple(c / total for c in counts), mean))
        first = group[0]
        grids.append(AcceptanceGrid({name: getattr(first, name, None) for name in SETTING_NAMES}, "", lengths,
                                    tuple(rows)))
    # Labels name what varies between the grids (c=1, c=4), as the recommendations' do.
    return [AcceptanceGrid(g.setting, label, g.lengths, g.rows)
            for g, (label, _) in zip(grids, labelled(grids))]  # type: ignore[arg-type]
