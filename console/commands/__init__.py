"""Subcommands of `ddtree-console`: one module per command, each with
`add_parser(subparsers) -> None` and `run(args) -> int` (see ddtree.console.cli)."""
