"""Acceptance figures from an engine: per request (`meta_info`) and per run (Prometheus counters).

A run's acceptance length is never read from `/server_info`'s `avg_spec_accept_length` alone: that
figure is cumulative since the server booted, so it mixes every run (and warm-up) the server has
served. Per run we scrape `/metrics` before and after and take differences of counters:

- SGLang (and the builtin server, which exports the same names): tau = d(sglang:generation_tokens_total)
  / d(sglang:spec_verify_calls_total), which is SGLang's own `spec_accept_length` definition
  (completion tokens per verify call, bonus included) summed over the run.
- vLLM: tau = 1 + d(vllm:spec_decode_num_accepted_tokens_total) / d(vllm:spec_decode_num_drafts_total);
  acceptance rate = d(accepted) / d(vllm:spec_decode_num_draft_tokens_total).

Prometheus text is parsed by the small parser below, always. prometheus_client is a dev-only
dependency (the product must not need it), and its parser raises on the first line it dislikes,
whereas a scrape with one odd line should still yield the counters we need; the tests check this
parser against prometheus_client's on real payloads.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from ddtree.engine.errors import EngineError


class MetricsError(EngineError):
    """A metrics payload or meta_info that cannot be used."""


# -- Prometheus text ---------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^\s*({_NAME})\s*(\{{.*\}})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


@dataclass(frozen=True)
class Scrape:
    """One /metrics payload. `skipped` counts lines that did not parse (kept out, not fatal)."""

    samples: tuple[Sample, ...]
    at: float = 0.0
    skipped: int = 0
    types: dict = field(default_factory=dict)

    def names(self) -> set[str]:
        return {s.name for s in self.samples}

    def select(self, name: str, **labels: str) -> list[Sample]:
        return [s for s in self.samples
                if s.name == name and all(s.label(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float | None:
        """Sum over every label set of `name` (is_streaming, engine, rank...); None when absent."""
        found = [s.value for s in self.select(name, **labels) if not math.isnan(s.value)]
        return sum(found) if found else None

    def by_label(self, name: str, key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.select(name):
            label = s.label(key)
            if label is not None:
                out[label] = out.get(label, 0.0) + s.value
        return out


def _value(text: str) -> float:
    low = text.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(text)


def _labels(body: str) -> tuple[tuple[str, str], ...] | None:
    inner = body[1:-1].strip()
    out = []
    pos = 0
    while pos < len(inner):
        m = _LABEL.match(inner, pos)
        if not m:
            return None
        value = re.sub(r'\\\\|\\"|\\n', lambda x: _UNESCAPE[x.group(0)], m.group(2))
        out.append((m.group(1), value))
        pos = m.end()
    return tuple(out)


def parse_prometheus(text: str, *, at: float | None = None) -> Scrape:
    samples: list[Sample] = []
    types: dict[str, str] = {}
    skipped = 0
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            parts = stripped.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if not m:
            skipped += 1
            continue
        labels = _labels(m.group(2)) if m.group(2) else ()
        if labels is None:
            skipped += 1
            continue
        try:
            value = _value(m.group(3))
        except ValueError:
            skipped += 1
            continue
        samples.append(Sample(m.group(1), labels, value))
    return Scrape(tuple(samples), at=time.time() if at is None else at, skipped=skipped, types=types)


# -- per-run acceptance from two scrapes -------------------------------------------------------

SGLANG_TOKENS = "sglang:generation_tokens_total"
SGLANG_VERIFY = "sglang:spec_verify_calls_total"
SGLANG_REQUESTS = "sglang:num_requests_total"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_TOKENS = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class RunAcceptance:
    """Acceptance over the interval between two scrapes. None fields: not exported / no drafts."""

    source: str  # "sglang" | "vllm"
    tau: float | None  # mean tokens committed per verify round, bonus included
    verify_calls: float | None  # SGLang verify calls, or vLLM drafts (one per verify round)
    generated_tokens: float | None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accept_rate: float | None = None  # accepted drafts / proposed drafts (vLLM only)
    per_position: tuple[float, ...] = ()  # vLLM: share of rounds that accepted position i
    requests: float | None = None
    counter_reset: bool = False  # a counter went down: the server restarted in between
    seconds: float | None = None

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def _delta(before: Scrape, after: Scrape, name: str) -> tuple[float | None, bool]:
    a = after.total(name)
    if a is None:
        return None, False
    b = before.total(name)
    if b is None:
        return a, False
    if a < b:
        return a, True  # reset: the counter restarted from zero after `before`
    return a - b, False


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def run_acceptance(kind: str, before: Scrape, after: Scrape) -> RunAcceptance:
    """Acceptance between two scrapes of one server. `kind`: "sglang", "builtin" or "vllm"."""
    seconds = after.at - before.at if after.at and before.at else None
    if kind in ("sglang", "builtin"):
        tokens, r1 = _delta(before, after, SGLANG_TOKENS)
        verify, r2 = _delta(before, after, SGLANG_VERIFY)
        requests, r3 = _delta(before, after, SGLANG_REQUESTS)
        return RunAcceptance(source="sglang", tau=_ratio(tokens, verify), verify_calls=verify,
                             generated_tokens=tokens, requests=requests, counter_reset=r1 or r2 or r3,
                             seconds=seconds)
    if kind == "vllm":
        drafts, r1 = _delta(before, after, VLLM_DRAFTS)
        draft_tokens, r2 = _delta(before, after, VLLM_DRAFT_TOKENS)
        accepted, r3 = _delta(before, after, VLLM_ACCEPTED)
        tokens, r4 = _delta(before, after, VLLM_TOKENS)
        tau = None if accepted is None or not drafts else 1.0 + accepted / drafts
        per_pos: list[float] = []
        a_pos, b_pos = after.by_label(VLLM_PER_POS, "position"), before.by_label(VLLM_PER_POS, "position")
        if drafts:
            for pos in sorted(a_pos, key=lambda p: int(p) if p.isdigit() else 1 << 30):
                d = a_pos[pos] - b_pos.get(pos, 0.0)
                per_pos.append(max(d, 0.0) / drafts)
        return RunAcceptance(source="vllm", tau=tau, verify_calls=drafts, generated_tokens=tokens,
                             draft_tokens=draft_tokens, accepted_tokens=accepted,
                             accept_rate=_ratio(accepted, draft_tokens), per_position=tuple(per_pos),
                             counter_reset=r1 or r2 or r3 or r4, seconds=seconds)
    raise MetricsError(f"no acceptance counters known for engine kind {kind!r}")


# -- per-request acceptance from meta_info -----------------------------------------------------


@dataclass(frozen=True)
class RequestAcceptance:
    completion_tokens: int
    verify_ct: int | None  # None: the engine ran without speculation (or did not say)
    accept_length: float | None  # completion_tokens / verify_ct, as SGLang reports it
    accept_rate: float | None = None
    correct_drafts: int | None = None
    proposed_drafts: int | None = None
    histogram: tuple[int, ...] = ()  # index k: verify rounds that accepted k drafts (tau = k + 1)

    @property
    def tau_from_histogram(self) -> float | None:
        rounds = sum(self.histogram)
        return sum((k + 1) * n for k, n in enumerate(self.histogram)) / rounds if rounds else None


def _int(meta: dict, key: str) -> int | None:
    value = meta.get(key)
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return int(value)
    raise MetricsError(f"meta_info.{key} is not a number: {value!r}")


def _float(meta: dict, key: str) -> float | None:
    value = meta.get(key)
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    raise MetricsError(f"meta_info.{key} is not a number: {value!r}")


def request_acceptance(meta_info: dict) -> RequestAcceptance:
    """Read one response's meta_info (SGLang /generate, or the builtin server's)."""
    if not isinstance(meta_info, dict):
        raise MetricsError("meta_info is not an object")
    completion = _int(meta_info, "completion_tokens")
    if completion is None:
        raise MetricsError("meta_info has no completion_tokens")
    verify = _int(meta_info, "spec_verify_ct")
    verify = verify if verify else None
    accept_length = _float(meta_info, "spec_accept_length")
    if accept_length is None and verify:
        accept_length = completion / verify
    hist_raw = meta_info.get("spec_correct_drafts_histogram") or meta_info.get("spec_accept_histogram") or ()
    if not isinstance(hist_raw, (list, tuple)) or not all(isinstance(n, int) for n in hist_raw):
        raise MetricsError(f"meta_info's acceptance histogram is not a list of counts: {hist_raw!r}")
    return RequestAcceptance(completion_tokens=completion, verify_ct=verify, accept_length=accept_length,
                             accept_rate=_float(meta_info, "spec_accept_rate"),
                             correct_drafts=_int(meta_info, "spec_num_correct_drafts"),
                             proposed_drafts=_int(meta_info, "spec_num_proposed_drafts"),
                             histogram=tuple(hist_raw))


@dataclass(frozen=True)
class AcceptanceSummary:
    requests: int
    tau_mean: float | None  # mean of the per-request accept lengths
    tau_weighted: float | None  # sum(completion tokens) / sum(verify calls): weighted by verify count
    histogram: tuple[int, ...]  # summed over requests, SGLang layout

    def to_dict(self) -> dict:
        return {"requests": self.requests, "tau_mean": self.tau_mean, "tau_weighted": self.tau_weighted,
                "histogram": list(self.histogram)}


def summarize_requests(items: list[RequestAcceptance]) -> AcceptanceSummary:
    spec = [r for r in items if r.verify_ct]
    lengths = [r.accept_length for r in spec if r.accept_length is not None]
    verify = sum(r.verify_ct for r in spec)
    hist: list[int] = []
    for r in spec:
        if len(r.histogram) > len(hist):
            hist.extend([0] * (len(r.histogram) - len(hist)))
        for k, n in enumerate(r.histogram):
            hist[k] += n
    return AcceptanceSummary(
        requests=len(items),
        tau_mean=sum(lengths) / len(lengths) if lengths else None,
        tau_weighted=sum(r.completion_tokens for r in spec) / verify if verify else None,
        histogram=tuple(hist))


def fetch_scrape(base_url: str, *, client=None, timeout_s: float = 10.0, path: str = "/metrics") -> Scrape:
    """GET base_url/metrics and parse it. Raises MetricsError when the server does not export them."""
    import httpx

    url = base_url.rstrip("/") + path
    own = client is None
    client = client or httpx.Client(timeout=timeout_s, trust_env=False)
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise MetricsError(f"cannot read {url}: {type(exc).__name__}: {exc}") from None
    finally:
        if own:
            client.close()
    if response.status_code != 200:
        raise MetricsError(f"GET {url} answered {response.status_code}",
                           "SGLang exports metrics only with --enable-metrics")
    return parse_prometheus(response.text)
