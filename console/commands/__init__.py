"""Subcommands of `ddtree-console`: one module per command, each with
`add_parser(subparsers) -> None` and `run(args) -> int` (see ddtree.console.cli)."""

from __future__ import annotations

import argparse


def run_id(text: str) -> int:
    """argparse type for a run id (export, sweep --resume)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a run id (an integer), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a run id is >= 1, got {value}")
    return value
