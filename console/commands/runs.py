"""`ddtree-console runs`: list benchmark runs (sweeps) in the store.

    runs [--json] [--filter TEXT] [--limit N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ddtree.console import fmt
from ddtree.console.commands.jobs import limit
from ddtree.store.db import open_db
from ddtree.store.queries import list_runs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "runs",
        help="list benchmark runs (sweeps) and how many points they finished",
        description="List the benchmark runs in the store, newest first. --filter keeps runs whose name, "
        "model, drafter, engine, state or recipe contains TEXT (case-insensitive).",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--filter", metavar="TEXT", help="keep runs that mention TEXT")
    p.add_argument("--limit", type=limit, default=None, metavar="N", help="at most N runs")


def run(args: argparse.Namespace) -> int:
    with open_db(args.db) as db:
        runs = list_runs(db, text=args.filter, limit=args.limit)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in runs], indent=2, default=str))
        return 0
    if not runs:
        print("no runs match" if args.filter else "no runs yet (start one with `ddtree-console sweep RECIPE.toml`)")
        return 0
    rows = [
        [
            str(r.id),
            r.name or "-",
            r.engine_kind or "-",
            fmt.one_line(r.model, 36) or "-",
            r.state or "-",
            f"{r.points_done}/{r.points_total}" if r.points_total else str(r.points_done),
            str(r.points_failed),
            fmt.stamp(r.created_at),
        ]
        for r in runs
    ]
    print(fmt.table(["ID", "NAME", "ENGINE", "MODEL", "STATE", "POINTS", "FAILED", "CREATED"], rows))
    return 0
