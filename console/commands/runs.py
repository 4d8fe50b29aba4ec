"""`ddtree-console runs`: list benchmark runs (sweeps) in the store.

    runs [--json] [--filter TEXT] [--limit N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ddtree.console import fmt
from ddtree.console.commands.jobs import list_parser
from ddtree.console.export import unstable_cv
from ddtree.engine.serving.names import names_demo_pair, run_model_name
from ddtree.store.redact import redact
from ddtree.store.db import open_existing
from ddtree.store.queries import list_runs
from ddtree.store.sweeps import list_points
from ddtree.store.summary import best_budgets, labelled
from ddtree.store.insight import labelled_recommendations
from ddtree.store.sentinel import check_runs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = list_parser(subparsers, "runs", help="list benchmark runs (sweeps) and how many points they finished",
                    description="List the benchmark runs in the store, newest first. --filter keeps runs whose "
                    "name, model, drafter, engine, state or recipe contains TEXT (case-insensitive).",
                    limit_default=None, limit_help="at most N runs")
    p.add_argument("--filter", metavar="TEXT", help="keep runs that mention TEXT")


def run(args: argparse.Namespace) -> int:
    with open_existing(args.db) as db:
        runs = list_runs(db, text=args.filter, limit=args.limit, unnamed_model=names_demo_pair(args.filter or ""))
        verdicts = {r.id: labelled(best_budgets(list_points(db, r.id), unstable_cv=unstable_cv(r))) for r in runs}
        insight = run_insight(db, runs)
    if args.json:
        print(json.dumps([{**redact(dataclasses.asdict(r)), "best_budget": [{"label": label, **b.to_dict()}
                                                                    for label, b in verdicts[r.id]], **insight[r.id]}
                          for r in runs], indent=2, default=str))
        return 0
    if not runs:
        print("no runs match" if args.filter else "no runs yet (start one with `ddtree-console sweep RECIPE.toml`)")
        return 0
    rows = [
        [
            str(r.id),
            r.name or "-",
            r.engine_kind or "-",
            fmt.one_line(run_model_name(r.model), 36),
            r.state or "-",
            fmt.points(r.points_done, r.points_total),
            str(r.points_failed),
            fmt.stamp(r.created_at),
            verdict_cell(verdicts[r.id]),
        ]
        for r in runs
    ]
    print(fmt.table(["ID", "NAME", "ENGINE", "MODEL", "STATE", "POINTS", "FAILED", "CREATED", "VERDICT"], rows))
    for line in insight_lines(runs, insight):
        print(line)
    return 0


def verdict_cell(bests: list) -> str:
    """The best-budget verdicts of a run in one cell: "best 16", "tie 8,16", "c=1 best 16; c=4 tie 8,16"."""
    if not bests:
        return "-"
    if len(bests) == 1:
        return bests[0][1].verdict.short
    return fmt.one_line("; ".join(f"{label} {b.verdict.short}" for label, b in bests), 60)


def run_insight(db, runs: list) -> dict[int, dict]:
    """Per run, what `runs --json` adds to the verdict: `recommendation` (store.insight: the budget
    to serve with per setting, with gains and the repeats that would settle a tie) and `sentinel`
    (store.sentinel: the run against earlier runs of its fingerprint, and its flags)."""
    reports = check_runs(db, [r.id for r in runs])
    out = {}
    for r in runs:
        recs = labelled_recommendations(list_points(db, r.id))
        report = reports.get(r.id)
        out[r.id] = {"recommendation": [{"label": label, **rec.to_dict()} for label, rec in recs],
                     "sentinel": report.to_dict() if report is not None else None}
    return out


def insight_lines(runs: list, insight: dict[int, dict]) -> list[str]:
    """Under the table: one line per run and setting naming the budget to serve with, then each
    regression flag of the run ("run 7 c=1: serve budget 16 at ...", "run 7 ! c=4: tau collapsed ...")."""
    lines = []
    for r in runs:
        data = insight.get(r.id) or {}
        for rec in data.get("recommendation") or []:
            lines.append(f"run {r.id} {rec['label']}: {rec['line']}")
        for flag in (data.get("sentinel") or {}).get("lines") or []:
            lines.append(f"run {r.id} ! {flag}")
    return lines
