"""The `ddtree-console` command line.

Plain `ddtree-console` opens the Textual console; each subcommand is a module
`ddtree.console.commands.<name>` with `add_parser(subparsers)` and `run(args) -> int`.
`--version` is answered before anything else is imported, so it works in a bare install.
Errors of the three packages become one line `error: <message> (<hint>)` on stderr with their
exit code (2 bad input, 1 failure); argparse's own usage errors are one such line too, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sqlite3
import sys
from types import ModuleType
from typing import NoReturn

from ddtree.engine.units import one_line

#: Subcommands, in the order `--help` lists them.
COMMANDS = ("serve", "sweep", "download", "hw", "jobs", "runs", "export")

# One-line help for a command whose module cannot be imported here (not written yet, or a
# dependency missing from this environment).
_FALLBACK_HELP = {
    "serve": "run the builtin engine's HTTP server in the foreground",
    "sweep": "run a benchmark sweep from a recipe",
    "download": "download a model or drafter from the hub",
    "hw": "show GPUs, links, NUMA nodes, CPU, memory and disks",
    "jobs": "list, show, start, cancel and follow jobs",
    "runs": "list benchmark runs",
    "export": "export a run as csv, json, markdown or a recipe",
}

_DESCRIPTION = """\
Operator console for speculative decoding (DFlash block drafters, DDTree draft-tree
verification): downloads, hardware, engines, benchmark sweeps and their results.
Without a command it opens the terminal console."""

_EPILOG = """\
data: the store is a SQLite file at --db, else $DDTREE_DB, else
$XDG_DATA_HOME/ddtree-console/ddtree.db (~/.local/share/...); logs sit beside it in logs/.
Commands that need what is in it (runs, jobs, export, sweep --resume/--settle)
refuse a --db or $DDTREE_DB path where there is no store.
Run `ddtree-console COMMAND --help` for a command's options."""


class _Parser(argparse.ArgumentParser):
    """argparse with the house error format: one line `error: <what> (<hint>)`, exit 2, instead
    of a usage block plus `prog: error:` (subcommand parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {one_line(message, None)} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost subcommand parser returns first and its parents keep its mark, so leftover
        # arguments are blamed on the command they were given to (`jobs show 1 2` -> its --help).
        if extras and not hasattr(parsed, "_innermost_parser"):
            parsed._innermost_parser = self
        return parsed, extras

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        innermost = vars(parsed).pop("_innermost_parser", self)
        if extras:
            innermost.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def distribution_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddtree-console")
    except PackageNotFoundError:
        return "0+unknown"


def _wants_version(argv: list[str]) -> bool:
    """True if --version comes before any subcommand (so `jobs --version` is not ours)."""
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--version":
            return True
        if token == "--db":
            skip = True
            continue
        if token.startswith("-"):
            continue
        return False
    return False


class _Unavailable:
    """Stands in for a command module that cannot be imported (a broken or partial installation),
    so the other commands and --help still work and this one says why in one line."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def add_parser(self, subparsers: argparse._SubParsersAction) -> None:
        p = subparsers.add_parser(
            self.name,
            help=f"{_FALLBACK_HELP.get(self.name, self.name)} (cannot load: see its --help)",
            description=f"{_FALLBACK_HELP.get(self.name, self.name)}. Cannot load in this installation: {self.reason}.",
        )
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        print(f"error: the {self.name} command cannot load in this installation ({self.reason}; "
              "reinstall ddtree-console)", file=sys.stderr)
        return 1


def load_command(name: str) -> ModuleType | _Unavailable:
    module_name = f"ddtree.console.commands.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return _Unavailable(name, "its module is missing")
        return _Unavailable(name, f"it needs {exc.name!r}, which is not installed")
    except ImportError as exc:
        return _Unavailable(name, f"import failed: {exc}")


def _command_in(argv: list[str]) -> str | None:
    """The command `argv` runs, when it names one before any help flag (else None)."""
    rest = list(argv)
    while rest:
        token = rest.pop(0)
        if token in ("-h", "--help"):
            return None
        if token == "--db":
            rest = rest[1:]
        elif not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, ModuleType | _Unavailable]]:
    """The parser; with `only`, just that command's (the others' modules are not imported, which
    keeps every command's start-up free of what the others pull in: the store, numpy, the planner)."""
    from ddtree.console.commands import nonempty_path

    parser = _Parser(
        prog="ddtree-console",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {distribution_version()}")
    parser.add_argument(
        "--db", metavar="PATH", type=nonempty_path, default=None, help="the SQLite store (default: $DDTREE_DB, else under $XDG_DATA_HOME)"
    )
    parser.add_argument(
        "--demo", action="store_true",
        help="with the console: start the builtin engine on the demo pair unless one is running",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    modules = {}
    for name in (only,) if only else COMMANDS:
        module = load_command(name)
        module.add_parser(sub)
        modules[name] = module
        # Accept --db after the command too (`ddtree-console jobs --db X`), without overriding
        # a global --db given before it.
        cmd_parser = sub.choices.get(name)
        if cmd_parser is not None and "--db" not in cmd_parser._option_string_actions:
            cmd_parser.add_argument("--db", metavar="PATH", type=nonempty_path, default=argparse.SUPPRESS,
                                    help="the SQLite store")
    return parser, modules


def _console_only(argv: list[str]) -> argparse.Namespace | None:
    """The options, when `argv` opens the console (no command, no help): parsed without
    importing the command modules, which the console's first frame has no use for."""
    db, demo, rest = None, False, list(argv)
    while rest:
        token = rest.pop(0)
        if token == "--demo":
            demo = True
        elif token == "--db" and rest and rest[0] and not rest[0].startswith("-"):
            db = rest.pop(0)
        elif token.startswith("--db=") and len(token) > len("--db="):
            db = token[len("--db="):]
        else:
            return None  # a command, --help, or something for argparse to explain
    return argparse.Namespace(db=db, demo=demo, command=None)


def _run_console(args: argparse.Namespace) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("error: the console needs a terminal (run it in one, or use a command; see --help)", file=sys.stderr)
        return 2
    from ddtree.console.app import run_app

    return run_app(args.db, demo=args.demo)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _wants_version(argv):
        print(f"ddtree-console {distribution_version()}")
        return 0
    console_args = _console_only(argv)
    if console_args is not None:
        return _console_main(console_args)
    from ddtree.engine.errors import EngineError
    from ddtree.jobs.errors import JobError
    from ddtree.store.errors import StoreError

    parser, modules = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    if args.command is not None and args.demo:
        # it would be dropped unseen: the command starts no console
        parser.error(f"--demo starts the console with the demo engine; it does nothing with `{args.command}`")
    try:
        if args.command is None:
            return _run_console(args)
        return int(modules[args.command].run(args) or 0)
    except (EngineError, JobError, StoreError) as exc:
        print(f"error: {one_line(exc, None)}", file=sys.stderr)
        return exc.exit_code
    except sqlite3.OperationalError as exc:
        # A write the store did not wrap: a read-only file (or folder) is bad input, with a way out.
        if "readonly" not in str(exc) and "read-only" not in str(exc):
            raise
        print(f"error: the database is read-only: {one_line(exc, None)} (make the file and its folder writable, "
              "or pass another path with --db or DDTREE_DB)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `ddtree-console jobs | head`: the reader left; not an error worth a traceback.
        sys.stderr.close()
        return 0


def _console_main(args: argparse.Namespace) -> int:
    try:
        return _run_console(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
