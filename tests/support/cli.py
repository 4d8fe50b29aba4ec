"""Console commands run in process, parsed the way the CLI's main parses them."""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout

from ddtree.console.commands import hw as hw_cmd
from ddtree.engine.errors import EngineError


def run_hw(argv: list[str], db: str | None = None) -> tuple[int, str]:
    """`ddtree-console [--db DB] hw ARGV`: (exit code, stdout), or on an error its exit code and the
    one `error: ...` line the CLI prints."""
    parser = argparse.ArgumentParser(prog="ddtree-console")
    parser.add_argument("--db")
    hw_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([*(["--db", db] if db else []), "hw", *argv])
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            rc = hw_cmd.run(args)
    except EngineError as exc:
        return exc.exit_code, f"error: {exc}"
    return rc, out.getvalue()
