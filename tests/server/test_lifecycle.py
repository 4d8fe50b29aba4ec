"""Process lifecycle: `ddtree-console serve` execs the server; SIGTERM drains in-flight work, exits 0."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

import httpx
import pytest

from ddtree.console.commands import serve
from ddtree.engine.client import EngineClient

from .conftest import ServerProcess

CLI = [sys.executable, "-m", "ddtree.console.cli"]


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


@pytest.mark.parametrize("argv", [["--budget", "-1"], ["--port", "70000"], ["--algorithm", "medusa"]])
def test_serve_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2


def test_serve_help_documents_the_options():
    import subprocess

    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--draft", "--algorithm", "--budget", "--block-size", "--device", "--host", "--port"):
        assert flag in out.stdout
    bad = subprocess.run([*CLI, "serve", "--budget", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--budget" in bad.stderr


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    proc = ServerProcess([*CLI, "serve", "--model", str(target),
                          "--draft", str(drafter), "--budget", "8"], tmp_path / "serve.log")
    try:
        assert proc.announcement["host"] == "127.0.0.1" and proc.port > 0
        result = {}

        def stream():
            with EngineClient(proc.url, timeout=120) as c:
                result["chunks"] = list(c.generate_stream(
                    "def main():", sampling_params={"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}))

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the request is running
            info = httpx.get(proc.url + "/server_info").json()["internal_states"][0]
            if info["generation_tokens_total"] > 0:
                break
            time.sleep(0.02)
        proc.proc.send_signal(signal.SIGTERM)
        t.join(60)
        last = result["chunks"][-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
        assert proc.proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(proc.url + "/health", timeout=2)
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def test_bad_model_directory_is_a_clean_error(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "ddtree.engine.reference.server", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in out.stderr
