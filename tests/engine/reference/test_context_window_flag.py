"""The builtin server's --context-window: parsed, passed on by builtin_argv, refused below 2."""

import argparse

from ddtree.engine.reference import server
from ddtree.engine.serving.launch import add_builtin_options, builtin_argv


def test_the_flag_parses_and_builtin_argv_passes_it_on():
    parser = argparse.ArgumentParser()
    add_builtin_options(parser, passthrough=True)
    assert parser.parse_args([]).context_window is None
    assert parser.parse_args(["--context-window", "4096"]).context_window == 4096
    argv = builtin_argv(context_window=4096)
    assert argv[argv.index("--context-window") + 1] == "4096"
    assert "--context-window" not in builtin_argv()


def test_the_server_refuses_a_window_below_two_in_one_line(capsys):
    assert server.main(["--context-window", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("--context-window must be at least 2, got 1" in line for line in err)


def test_serve_passes_the_window_to_the_server():
    from ddtree.console import cli
    from ddtree.console.commands import serve

    parser, _ = cli.build_parser("serve")
    args = parser.parse_args(["serve", "--context-window", "2048"])
    argv = serve.server_argv(args)
    assert argv[argv.index("--context-window") + 1] == "2048"


def test_the_server_refuses_a_prefill_cap_below_one_and_serve_passes_it_on(capsys):
    """--max-prefill-tokens (the scheduler's per-turn prefill cap) sits beside --context-window."""
    from ddtree.console import cli
    from ddtree.console.commands import serve

    assert server.main(["--max-prefill-tokens", "0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("--max-prefill-tokens must be at least 1, got 0" in line for line in err)
    parser, _ = cli.build_parser("serve")
    argv = serve.server_argv(parser.parse_args(["serve", "--max-prefill-tokens", "2048"]))
    assert argv[argv.index("--max-prefill-tokens") + 1] == "2048"
