"""The serve command's arguments and failures that never reach a running server.

(The running server, started through `ddtree-console serve`, and its SIGTERM drain are tested at
the end of test_api.py, so the suite starts one server, not two.)"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ddtree.console.commands import serve

from .conftest import CLI


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_serve_arguments_map_to_the_server_command_line():
    argv = serve.server_argv(parse("--model", "m", "--draft", "d", "--budget", "12", "--port", "0"))
    assert argv[:3] == [sys.executable, "-m", "ddtree.engine.reference.server"]
    joined = " ".join(argv)
    assert "--model m" in joined and "--draft d" in joined and "--budget 12" in joined
    assert "--host 127.0.0.1" in joined and "--algorithm ddtree" in joined

def test_serve_passes_batching_through_only_when_asked():
    assert "--no-batch" in serve.server_argv(parse("--no-batch"))
    assert "--batch" in serve.server_argv(parse("--batch"))
    plain = serve.server_argv(parse())
    assert "--batch" not in plain and "--no-batch" not in plain



@pytest.mark.parametrize("argv", [["--budget", "-1"], ["--port", "70000"], ["--algorithm", "medusa"]])
def test_serve_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2


def test_serve_help_documents_the_options():
    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--draft", "--algorithm", "--budget", "--block-size", "--device", "--host", "--port"):
        assert flag in out.stdout
    bad = subprocess.run([*CLI, "serve", "--budget", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--budget" in bad.stderr


def test_bad_model_directory_is_a_clean_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ddtree.engine.reference.server", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in out.stderr


def test_batch_flag():
    from ddtree.engine.reference.server import DEFAULT_BATCH, build_parser

    parser = build_parser()
    assert parser.parse_args([]).batch is None
    assert parser.parse_args(["--batch"]).batch is True
    assert parser.parse_args(["--no-batch"]).batch is False
    assert DEFAULT_BATCH is True
