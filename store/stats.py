"""Statistics over the repeats of a sweep point: summaries, paired ratios, and the best-budget verdict.

Pure Python (no scipy, no torch): every reader of the store (the CLI's `runs` and `export`, the
console's Sweeps pane) gets its figures and its verdict from here, so they never disagree.

- `summary(values)`: median, mean, sample standard deviation, a 95% confidence interval for the
  mean from Student's t distribution, the coefficient of variation (sd / mean).
- `paired_ratio(points, baselines)`: a point against a baseline from paired repeats (repeat i with
  repeat i): the geometric mean of the per-repeat ratios, with a t interval on the log scale
  (ratios multiply, so their spread is symmetric in log, not in the ratio itself).
- `verdict(candidates)`: the highest mean is "best" only when its interval lies wholly above the
  runner-up's; otherwise the candidates whose intervals reach the leader's are a "tie within
  noise". With single repeats there is no interval, and the verdict says so instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

#: Two-sided 95% quantiles of Student's t (t_{0.975, df}) for df 1..30, to three decimals.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.959963984540054

#: A point whose repeats vary by more than this coefficient of variation is flagged unstable
#: (the recipe's `sweep.unstable_spread` overrides it).
UNSTABLE_CV = 0.10


def t975(df: int) -> float:
    """t_{0.975} with `df` degrees of freedom: the table up to 30, then the Cornish-Fisher series
    in 1/df around the normal quantile (within 1e-4 of the exact value from 30 on)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3


@dataclass(frozen=True)
class Summary:
    """What the repeats of one figure say. Fields beyond `n`, `median` and `mean` are None with
    fewer than two values (one sample has no spread)."""

    n: int
    median: float | None = None
    mean: float | None = None
    sd: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    cv: float | None = None
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"n must be >= 0, got {self.n}")

    @property
    def has_interval(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def summary(values) -> Summary:
    """The summary of the values that are not None."""
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    if n == 0:
        return Summary(0)
    mean = sum(xs) / n
    if n == 1:
        return Summary(1, median=xs[0], mean=mean, low=xs[0], high=xs[0])
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return Summary(n, median=median(xs), mean=mean, sd=sd, ci_low=mean - half, ci_high=mean + half,
                   cv=sd / abs(mean) if mean else None, low=min(xs), high=max(xs))


@dataclass(frozen=True)
class Ratio:
    """A point against a baseline. `paired` is False when no repeat numbers matched and the value
    is the ratio of medians (then there is no interval)."""

    value: float | None
    n: int = 0
    ci_low: float | None = None
    ci_high: float | None = None
    paired: bool = True

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def paired_ratio(values: dict[int, float], baselines: dict[int, float]) -> Ratio:
    """`values[i] / baselines[i]` over the repeats both have: geometric mean and 95% interval."""
    pairs = [(values[i], baselines[i]) for i in sorted(values) if i in baselines
             and values[i] is not None and baselines[i] and values[i] > 0 and baselines[i] > 0]
    if not pairs:
        num = [v for v in values.values() if v is not None]
        den = [b for b in baselines.values() if b]
        if num and den:
            return Ratio(median(num) / median(den), n=0, paired=False)
        return Ratio(None, n=0)
    logs = summary([math.log(v / b) for v, b in pairs])
    if not logs.has_interval:
        return Ratio(math.exp(logs.mean), n=logs.n)
    return Ratio(math.exp(logs.mean), n=logs.n, ci_low=math.exp(logs.ci_low), ci_high=math.exp(logs.ci_high))


@dataclass(frozen=True)
class Verdict:
    """Which candidate is best, if the repeats can tell.

    state: "best" (the leader's interval clears the runner-up's), "tie" (it does not: `tied` names
    the candidates within noise of the leader, leader first), "untested" (a candidate has fewer than
    two repeats, so there is no interval: `best` is merely the highest), "single" (one candidate),
    "none" (nothing measured)."""

    state: str
    best: object = None
    tied: tuple = ()
    mean: float | None = None
    text: str = ""
    unstable: tuple = field(default=())
    note: str = ""  # the unstable flag, e.g. "unstable (CV > 10%): budgets 32"

    STATES = ("best", "tie", "untested", "single", "none")

    def __post_init__(self) -> None:
        if self.state not in self.STATES:
            raise ValueError(f"unknown verdict state {self.state!r}")

    @property
    def short(self) -> str:
        """A table cell: "best 16", "tie 8,16", "16? untested", "only 16", "-" (+ " unstable")."""
        text = {"best": f"best {self.best}", "tie": "tie " + ",".join(str(x) for x in self.tied),
                "untested": f"{self.best}? untested", "single": f"only {self.best}", "none": "-"}[self.state]
        return text + (" unstable" if self.unstable else "")

    @property
    def full(self) -> str:
        return f"{self.text}; {self.note}" if self.note else self.text

    def to_dict(self) -> dict:
        return {"state": self.state, "best": self.best, "tied": list(self.tied), "mean": self.mean,
                "text": self.full, "unstable": list(self.unstable)}


def _names(labels) -> str:
    return ", ".join(str(x) for x in labels)


def verdict(candidates: list[tuple[object, Summary]], *, noun: str = "budget", unit: str = "tok/s",
            unstable_cv: float = UNSTABLE_CV) -> Verdict:
    """The verdict over (label, summary of its repeats) pairs, e.g. budgets and their output tok/s."""
    measured = [(label, s) for label, s in candidates if s.n > 0 and s.mean is not None]
    if not measured:
        return Verdict("none", text=f"no {noun} measured yet")
    shaky = tuple(label for label, s in measured if s.cv is not None and s.cv > unstable_cv)
    ranked = sorted(measured, key=lambda item: -item[1].mean)
    leader, top = ranked[0]
    flag = f"unstable (CV > {unstable_cv:.0%}): {noun}s {_names(shaky)}" if shaky else ""
    if len(ranked) == 1:
        return Verdict("single", best=leader, mean=top.mean, unstable=shaky, note=flag,
                       text=f"only {noun} {leader}: {top.mean:.1f} {unit}")
    if any(not s.has_interval for _, s in ranked):
        return Verdict("untested", best=leader, mean=top.mean, unstable=shaky, note=flag,
                       text=f"highest {noun} {leader} at {top.mean:.1f} {unit}, untested: one repeat, "
                            f"no interval (set sweep.repeats >= 3)")
    runner = ranked[1][1]
    if top.ci_low > runner.ci_high:
        return Verdict("best", best=leader, mean=top.mean, unstable=shaky, note=flag,
                       text=f"best {noun} {leader} at {top.mean:.1f} {unit} "
                            f"(95% CI {top.ci_low:.1f}-{top.ci_high:.1f}, clear of {noun} {ranked[1][0]})")
    tied = tuple(label for label, s in ranked if s.ci_high >= top.ci_low)
    return Verdict("tie", best=None, tied=tied, mean=top.mean, unstable=shaky, note=flag,
                   text=f"tie within noise: {noun}s {_names(tied)}")
