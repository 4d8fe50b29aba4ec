"""`ddtree-console export RUN_ID --format csv|json|md|recipe [-o FILE]`.

The formats are rendered by ddtree.console.export (which the console's export dialog uses too):
csv one row per point, json the run with its points and summary, md the summary as a table,
recipe TOML that reproduces the run.
"""

from __future__ import annotations

import argparse
import sys

from ddtree.console.commands import nonempty_path, run_id
from ddtree.console.export import FORMATS, export_run, export_text
from ddtree.store.db import open_existing


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="export a run as CSV, JSON, a Markdown table or a recipe",
                              description="Export a sweep run: csv (one row per point), json (run, points, "
                                          "summary), md (a table of the grid), recipe (TOML that reproduces it).")
    p.add_argument("run_id", type=run_id, metavar="RUN_ID", help="the run (see `ddtree-console runs`)")
    p.add_argument("--format", choices=FORMATS, default="csv", help="output format (default: csv)")
    p.add_argument("-o", "--output", metavar="FILE", type=nonempty_path, help="write to FILE instead of stdout (- for stdout)")
    p.set_defaults(command_module=__name__)


def run(args: argparse.Namespace) -> int:
    with open_existing(getattr(args, "db", None)) as db:
        if args.output and args.output != "-":
            export_run(db, args.run_id, args.format, args.output)
        else:
            sys.stdout.write(export_text(db, args.run_id, args.format))
    return 0
