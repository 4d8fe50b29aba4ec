"""Rendering a sweep run as csv, json, Markdown or a recipe, and writing it to a file: what
`ddtree-console export` and the console's export dialog both use.

    render(run_row, points, fmt) -> str
    export_text(db, run_id, fmt) -> str
    export_run(db, run_id, fmt, path, *, make_parents=False) -> Path

csv: one row per point (every repeat), JSON columns as JSON text. json: the run (recipe, hardware,
software) with its points and a per-cell summary (medians over repeats). md: that summary as a
Markdown table. recipe: TOML that reproduces the run elsewhere (`sweep` reads it back unchanged).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import time
from pathlib import Path

from ddtree.console.files import write_output
from ddtree.console.widgets.heatmap import heatmap_markdown
from ddtree.engine.serving.names import run_drafter_name, run_model_name
from ddtree.jobs.errors import JobError
from ddtree.jobs.recipe import RecipeError, recipe_from_dict, recipe_to_toml
from ddtree.store.redact import redact
from ddtree.store import contention, sweeps
from ddtree.store.stats import UNSTABLE_CV
from ddtree.store.insight import acceptance_grids, labelled_recommendations, serving_comment, serving_settings
from ddtree.store.summary import best_budgets, labelled

#: What each figure of the exports is (README.md's Metrics section defines them in full).
METRIC_LABELS = {
    "output_tok_s": "output tok/s: completion tokens of successful requests / wall time of the point",
    "tok_s_per_user": "per-user output tok/s: output tok/s / mean requests in flight (at least 1)",
    "tau_weighted": "tau weighted by verify count: accepted tokens per verify round, pooled over requests",
    "tau_mean": "tau mean: mean over requests of SGLang's spec_accept_length",
    "ttft_p50": "TTFT p50 (s): time to first token",
    "itl_p50": "ITL p50 (s): inter-token latency",
    "e2e_p50": "E2E p50 (s): request latency, send to last token",
    "speedup_vs_ar": "x AR: geometric mean of paired repeats' output tok/s ratios (repeat i / AR repeat i)",
}

FORMATS = ("csv", "json", "md", "recipe")


class ExportError(JobError):
    exit_code = 2


def export_text(db, run_id: int, fmt: str) -> str:
    """Run `run_id` of the store `db` rendered as `fmt`."""
    run_row = sweeps.get_run(db, run_id)
    return render(run_row, sweeps.list_points(db, run_row.id), fmt)


def export_run(db, run_id: int, fmt: str, path: str | os.PathLike, *, make_parents: bool = False) -> Path:
    """Write run `run_id` as `fmt` to `path` (files.write_output: atomic for a regular file); the
    path written. `make_parents` creates missing folders (the console's default export folder)."""
    return write_output(path, export_text(db, run_id, fmt), make_parents=make_parents)


def render(run_row, points: list[sweeps.Point], fmt: str) -> str:
    if fmt == "csv":
        return to_csv(points)
    if fmt == "json":
        return json.dumps(to_json(run_row, points), indent=2, sort_keys=False) + "\n"
    if fmt == "md":
        return to_markdown(run_row, points)
    if fmt == "recipe":
        return to_recipe(run_row, points)
    raise ExportError(f"unknown format {fmt!r}", "allowed: " + ", ".join(FORMATS))


def to_csv(points: list[sweeps.Point]) -> str:
    buf = io.StringIO()
    names = list(sweeps.Point.__dataclass_fields__)
    # the contention reading flattened into plain columns (the JSON `contention` column keeps it whole)
    extra = [c for c in contention.EXPORT_COLUMNS if c not in names]
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(names + extra)
    for p in points:
        row = []
        flat = contention.export_fields(p)
        for name in names:
            value = getattr(p, name)
            row.append(json.dumps(value) if isinstance(value, (list, dict)) else ("" if value is None else value))
        row.extend("" if flat[c] is None else flat[c] for c in extra)
        writer.writerow(row)
    return buf.getvalue()


def to_json(run_row, points: list[sweeps.Point]) -> dict:
    run_fields = {k: getattr(run_row, k) for k in run_row.__dataclass_fields__
                  if k not in ("points_done", "points_failed")}
    run_fields["recipe"] = redact(run_fields.get("recipe"))  # a row stored before redaction existed
    cv = unstable_cv(run_row)
    return {"run": run_fields, "points": [{**p.to_dict(), **contention.export_fields(p)} for p in points],
            "busy_box": contention.run_busy_note(points),
            "summary": sweeps.summarize(points, unstable_cv=cv),
            "best_budget": [{"label": label, **best.to_dict()}
                            for label, best in labelled(best_budgets(points, unstable_cv=cv))],
            "recommended_serving": serving_settings(points),
            "acceptance": [grid.to_dict() for grid in acceptance_grids(points)],
            "metrics": METRIC_LABELS}


def unstable_cv(run_row) -> float:
    """The recipe's CV threshold for unstable points (the default when the recipe cannot say)."""
    try:
        return recipe_from_dict(run_row.recipe).sweep.unstable_spread
    except (RecipeError, TypeError):
        return UNSTABLE_CV


def to_recipe(run_row, points: list[sweeps.Point] | None = None) -> str:
    try:
        recipe = recipe_from_dict(redact(run_row.recipe))
    except RecipeError as exc:
        raise ExportError(f"run {run_row.id} holds no readable recipe: {exc}") from None
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(run_row.created_at))
    host = ((run_row.hardware or {}).get("host") or {}).get("hostname") if isinstance(run_row.hardware, dict) else None
    comment = f"exported from run {run_row.id} ({run_row.name}), {stamp}" + (f" on {host}" if host else "")
    if run_row.recipe_git_rev:
        comment += f"\nrecipe file {run_row.recipe_path} at git {run_row.recipe_git_rev}"
    comment += ("\nevery effective setting is written out, defaults resolved, but for what belongs to this "
                "machine\n(the demo pair's folders, the interpreter), which the machine that runs it resolves")
    serving = serving_comment(points or [])
    if serving:
        comment += "\n" + serving
    return recipe_to_toml(resolved(recipe, run_row.name), comment=comment, explicit=True)


def resolved(recipe, name: str | None = None):
    """The recipe as the run ran it, to reproduce elsewhere: the run's name (--name may have
    replaced the recipe's) and the request API made explicit. The demo pair's folders and the
    interpreter stay left out where the recipe left them out: written out, they would name this
    machine's install, which the bigger machine a recipe is exported for does not have."""
    engine = dataclasses.replace(recipe.engine, api=recipe.engine.request_api)
    return dataclasses.replace(recipe, name=name or recipe.name, engine=engine)


def _cell(value, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, fmt)
    return str(value)


def _ratio(ratio: dict | None) -> str:
    if not ratio or ratio.get("value") is None:
        return "-"
    if ratio.get("ci_low") is None:
        return f"{ratio['value']:.2f}"
    return f"{ratio['value']:.2f} [{ratio['ci_low']:.2f}-{ratio['ci_high']:.2f}]"


def _bullets(title: str, items: list[tuple[str, str]]) -> list[str]:
    """A markdown section of "- label: text" lines (nothing when there are no items)."""
    if not items:
        return []
    return [f"## {title}", "", *(f"- {label}: {text}" for label, text in items), ""]


def to_markdown(run_row, points: list[sweeps.Point]) -> str:
    lines = [f"# Run {run_row.id}: {run_row.name}", ""]
    hw = run_row.hardware if isinstance(run_row.hardware, dict) else {}
    gpus = hw.get("gpus") or []
    host = hw.get("host") or {}
    device = (f"{len(gpus)} x {gpus[0].get('name')}" if gpus else (host.get("cpu_model") or "CPU"))
    lines.append(f"- engine: {run_row.engine_kind}, model {run_model_name(run_row.model)}, "
                 f"draft {run_drafter_name(run_row.draft_model, run_row.model)}")
    done = sum(p.state in sweeps.FINISHED_POINT_STATES for p in points)
    lines.append(f"- hardware: {device}; state: {run_row.state}; points: {done} of {len(points)} finished")
    busy = contention.run_busy_note(points)
    if busy:
        lines.append(f"- **warning: {busy}**: other work competed with these points; their figures may be noise "
                     "(see Contention below)")
    lines.append("")
    cv_limit = unstable_cv(run_row)
    bests = labelled(best_budgets(points, unstable_cv=cv_limit))
    lines.extend(_bullets("Best budget", [(label, best.line) for label, best in bests]))
    recommended = labelled_recommendations(points)
    lines.extend(_bullets("Budget to serve with", [(label, rec.text) for label, rec in recommended]))
    heatmap = heatmap_markdown(points)
    if heatmap:
        lines.extend(heatmap)
        lines.append("")
    header = ["algorithm", "budget", "c", "dataset", "T", "out tok/s (median)", "95% CI", "CV", "tok/s/user",
              "x AR [95% CI]", "x DFlash [95% CI]", "tau (weighted by verify)", "tau (mean of requests)",
              "TTFT p50 s", "ITL p50 ms", "E2E p99 s", "repeats", "note"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for row in sweeps.summarize(points, unstable_cv=cv_limit):
        note = []
        if row["unstable"]:
            note.append(f"unstable (CV {row['cv']:.0%} > {cv_limit:.0%})")
        if row.get("contended"):
            note.append(f"busy box ({row['contended']}/{row['repeats']} repeats)")
        if row["baseline"]:
            note.append("baseline")
        if "done" not in row["states"]:
            note.append("/".join(row["states"]) + (f": {row['error']}" if row["error"] else ""))
        itl = row["itl_p50"] * 1000 if row["itl_p50"] is not None else None
        tok = row["output_tok_s_stats"]
        ci = f"{tok['ci_low']:.1f}-{tok['ci_high']:.1f}" if tok["ci_low"] is not None else "-"
        cells = [row["algorithm"], _cell(row["budget"]), _cell(row["concurrency"]), row["dataset"],
                 _cell(row["temperature"], "g"), _cell(row["output_tok_s"], ".1f"), ci,
                 _cell(row["cv"], ".1%") if row["cv"] is not None else "-", _cell(row["tok_s_per_user"], ".1f"),
                 _ratio(row["vs_ar"]), _ratio(row["vs_dflash"]), _cell(row["tau_weighted"]),
                 _cell(row["tau_mean"]), _cell(row["ttft_p50"], ".3f"), _cell(itl, ".1f"), _cell(row["e2e_p99"]),
                 f"{row['repeats_done']}/{row['repeats']}", "; ".join(note).replace("|", "/")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    lines.extend(_contention_section(points))
    lines.append("tau (weighted by verify): accepted tokens per verify round pooled over the point's requests; "
                 "tau (mean of requests): the mean of SGLang's per-request spec_accept_length. "
                 "Intervals are 95% (Student's t over repeats); ratios pair repeat i with the baseline's repeat i.")
    return "\n".join(lines) + "\n"


def _contention_section(points: list[sweeps.Point]) -> list[str]:
    """A table of the points that ran on a busy box (nothing when none did)."""
    busy = contention.contended_points(points)
    if not busy:
        return []
    header = ["point", "algorithm", "budget", "c", "repeat", "load 1m", "CPU %", "others (cores)",
              "GPU others", "clock events", "why"]
    lines = ["## Contention", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for p in busy:
        f = contention.export_fields(p)
        cells = [_cell(p.idx), p.algorithm, _cell(p.budget), _cell(p.concurrency), _cell(p.repeat),
                 _cell(f["host_load1"], ".1f"), _cell(f["host_cpu_percent"], ".0f"), _cell(f["others_cpu_cores"]),
                 _cell(f["gpu_other_processes"]), f["gpu_clock_events"] or "-", (f["busy_reasons"] or "-")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    lines.append("")
    return lines
