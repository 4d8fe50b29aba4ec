"""The `ddtree-console` command line."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-console",
        description="Operator console for speculative decoding (DFlash drafters, DDTree verification).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('ddtree-console')}")
    return parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
