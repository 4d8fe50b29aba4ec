"""One sweep point against a running engine: its prompts, warm-up, measured requests, scrapes and record.

Acceptance per point comes two ways: per request from meta_info (engine/serving/bench.py), and over
the point from the difference of the server's Prometheus counters scraped just before and just
after it (warm-up excluded) -> points.tau_counters. The cumulative /server_info figure is never used.
While the point runs, its GPUs are sampled (telemetry, for the point's mean utilisation and power)
and the machine is watched for other work (points.contention).

A point that fails (every request failed, the engine died) is recorded with its cause; one whose
error rate or p99 latency crosses the recipe's limits says so, and the loop skips the higher
concurrencies of its series.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from ddtree.engine.errors import EngineError
from ddtree.engine.machine.contention import Watch, busy_note, busy_reasons
from ddtree.engine.serving.bench import BenchConfig, PointResult, run_point
from ddtree.engine.serving.metrics import (SGLANG_REQUESTS, MetricsError, RunAcceptance, Scrape, fetch_scrape,
                                           run_acceptance)
from ddtree.engine.serving.prompts import load_prompts
from ddtree.jobs.engine_process import EngineProcess
from ddtree.jobs.plan import Plan, PlanPoint
from ddtree.store import sweeps
from ddtree.store.contention import record_contention
from ddtree.store.db import open_db
from ddtree.store.telemetry import TelemetryWriter

# SGLang counts a request in its counters as it finishes it, which may be just after the client
# has the response: the scrape after a point waits this long at most for the counts to settle.
COUNTER_SETTLE_S = 3.0


class _GpuWatch:
    """Samples the point's GPUs while it runs (nothing on a machine without NVML GPUs)."""

    def __init__(self, ctx, point_id: int, gpus: tuple[int, ...]) -> None:
        self.ctx, self.point_id, self.gpus = ctx, point_id, list(gpus)
        self.stop_event = threading.Event()
        self.thread = None
        self.db = None

    def __enter__(self) -> _GpuWatch:
        from ddtree.engine.machine.hw import nvml
        from ddtree.engine.machine.sampler import Sampler, SamplerConfig

        # Before the sampler starts: its first sample may come before this thread runs again, and
        # means() counts samples from t0 on (a loaded CI box left it none).
        self.t0 = time.time()
        session = nvml()
        if session.start() is None and session.count > 0:
            self.db = open_db(self.ctx.db_path)  # the sampler's thread writes through its own connection
            writer = TelemetryWriter(self.db, labels={"job_id": self.ctx.job_id, "point_id": self.point_id})
            self.thread = Sampler(SamplerConfig(rate_hz=2.0), session=session).start(self.stop_event, sink=writer)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.db.close()

    def means(self) -> tuple[float | None, float | None]:
        if self.thread is None:
            return None, None
        return sweeps.telemetry_means(self.ctx.db, self.t0, time.time(), self.gpus or None)


def measure_point(ctx, plan: Plan, point: PlanPoint, point_id: int, engine: EngineProcess) -> tuple[str, str | None]:
    """Run one point against the running engine and record it; (its state, and why the higher
    concurrencies of its series are to be skipped, or None). Raises JobCancelled when the job is
    cancelled mid-point (the point goes back to pending for a resume)."""
    recipe, sweep = plan.recipe, plan.recipe.sweep
    db = ctx.db
    budget = "" if point.budget is None else f" budget={point.budget}"  # AR and DFlash have none
    label = (f"point {point.index + 1}/{len(plan.points)}: {point.algorithm}{budget} "
             f"c={point.concurrency} T={point.temperature:g} {point.dataset} r{point.repeat}")
    started = time.time()
    sweeps.mark_point(db, point_id, "running", started_at=started)
    ctx.progress(message=f"{label} running")
    try:
        prompts = load_prompts(point.dataset, sweep.num_prompts, seed=sweep.seed)
        warm = load_prompts(point.dataset, sweep.warmup, seed=sweep.seed, offset=sweep.num_prompts) \
            if sweep.warmup else []
    except EngineError as exc:
        sweeps.record_point(db, point_id, state="failed", metrics={}, requests=[], error=str(exc), started_at=started)
        ctx.log(f"{label} failed: {exc}")
        return "failed", None
    speculative = None
    if recipe.engine.per_request_spec:
        speculative = {"algorithm": point.algorithm}
        if point.budget is not None:
            speculative["budget"] = point.budget
    # Warm-up runs on its own, before the first scrape, so the counter difference covers the
    # measured requests only.
    cfg = BenchConfig(concurrency=point.concurrency, max_new_tokens=sweep.max_new_tokens,
                      temperature=point.temperature, api=recipe.engine.request_api, request_rate=sweep.request_rate,
                      warmup=0, timeout_s=sweep.timeout_s, seed=sweep.seed, speculative=speculative,
                      model=recipe.engine.model)
    metrics_path = engine.spec.metrics_path
    warnings: list[str] = []
    with _GpuWatch(ctx, point_id, point.gpus) as gpu:
        if warm:
            warm_cfg = dataclasses.replace(cfg, request_rate=None, concurrency=max(1, min(cfg.concurrency, len(warm))))
            warmed = run_point(engine.url, warm, warm_cfg, stop=ctx.cancelled)
            if not any(r.ok for r in warmed.requests) and warmed.requests:
                first = warmed.requests[0]
                warnings.append(f"every warm-up request failed ({first.error}: {first.detail})")
        before = _scrape(engine.url, metrics_path) if not ctx.cancelled.is_set() else None
        box = Watch(our_pgids=(engine.proc.pid,) if engine.proc is not None else (), gpus=tuple(point.gpus))
        with box:
            result = run_point(engine.url, prompts, cfg, stop=ctx.cancelled)
        after = _scrape_settled(engine.url, metrics_path, before, result.metrics["requests_ok"])
        util, power = gpu.means()
    if ctx.cancelled.is_set():
        # An interrupted point is not a result: it goes back to pending for a resume.
        sweeps.mark_point(db, point_id, "pending")
        ctx.check_cancelled()
    counters = _counter_acceptance(engine, before, after, warnings)
    metrics = dict(result.metrics, gpu_util_mean=util, gpu_power_mean=power)
    state, error = _judge(result, engine)
    sweeps.record_point(db, point_id, state=state, metrics=metrics, requests=_request_rows(result), error=error,
                        warnings=warnings + result.warnings, started_at=started,
                        tau_counters=counters.tau if counters else None,
                        accept_counters=counters.to_dict() if counters else None)
    busy = busy_reasons(box.reading)
    record_contention(db, point_id, box.reading.to_dict(), busy)
    if busy:
        ctx.log(f"{label}: warning: {busy_note(busy)}")
    summary = (f"{label} {state}: {metrics['requests_ok']} ok, {metrics['requests_failed']} failed, "
               f"{_fmt(metrics.get('output_tok_s'))} tok/s, tau {_fmt(metrics.get('tau_weighted'))}"
               f" (counters {_fmt(counters.tau if counters else None)})")
    ctx.log(summary + (f" ({error})" if error else ""))
    cause = _saturation(metrics, sweep)
    if cause is None:
        return state, None
    ctx.log(f"{label}: saturated ({cause}); higher concurrencies of this series are skipped")
    return state, f"skipped: saturated at concurrency {point.concurrency} ({cause})"


def _scrape(url: str, path: str | None) -> Scrape | None:
    if not path:
        return None
    try:
        return fetch_scrape(url, path=path)
    except MetricsError:
        return None  # not exported (an engine without metrics): per-request figures only


def _scrape_settled(url: str, path: str | None, before: Scrape | None, requests_ok: int) -> Scrape | None:
    """The scrape after a point, once the server's request counter has counted the point's
    successful requests (or COUNTER_SETTLE_S passed; engines without that counter: at once)."""
    if before is None:
        return None
    deadline = time.monotonic() + COUNTER_SETTLE_S
    while True:
        after = _scrape(url, path)
        if after is None:
            return None
        now, then = after.total(SGLANG_REQUESTS), before.total(SGLANG_REQUESTS)
        if now is None or then is None or now - then >= requests_ok or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def _counter_acceptance(engine: EngineProcess, before: Scrape | None, after: Scrape | None,
                        warnings: list[str]) -> RunAcceptance | None:
    if before is None or after is None:
        return None
    kind = engine.spec.kind
    counters = run_acceptance(kind, before, after)
    if counters.counter_reset:
        warnings.append("the engine's counters went down during the point (it restarted): no counter figures")
        return None
    return counters


def _judge(result: PointResult, engine: EngineProcess) -> tuple[str, str | None]:
    gone = engine.died_reason()
    failures = result.metrics.get("failures") or {}
    if gone:
        return "failed", f"engine died during the point ({gone})"[:500]
    if result.metrics["requests_ok"] == 0:
        first = next((r for r in result.requests if r.error), None)
        detail = f": {first.detail}" if first is not None and first.detail else ""
        causes = ", ".join(f"{k} x{v}" for k, v in failures.items()) or "no requests ran"
        return "failed", f"every request failed ({causes}){detail}"[:500]
    return "done", None


def _saturation(metrics: dict, sweep) -> str | None:
    total = metrics["requests_ok"] + metrics["requests_failed"]
    if total and metrics["requests_failed"] / total > sweep.stop_error_rate:
        return f"error rate {metrics['requests_failed'] / total:.0%} > {sweep.stop_error_rate:.0%}"
    p99 = metrics.get("e2e_p99")
    if sweep.stop_e2e_p99_s is not None and p99 is not None and p99 > sweep.stop_e2e_p99_s:
        return f"p99 E2E {p99:.2f}s > {sweep.stop_e2e_p99_s:g}s"
    return None


def _request_rows(result: PointResult) -> list[dict]:
    return [{"idx": r.index, "ok": r.ok, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "ttft_s": r.ttft_s, "itl_mean_s": r.itl_mean_s, "e2e_s": r.e2e_s, "verify_ct": r.verify_ct,
             "accept_length": r.accept_length, "started_at": r.started_at, "error": r.error,
             "finish_reason": r.finish_reason, "detail": r.detail, "accept_hist": r.accept_hist}
            for r in result.requests]


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"
