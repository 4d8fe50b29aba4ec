"""The serve command's arguments and failures that never reach a running server.

(The running server, started through `ddtree-console serve`, and its SIGTERM drain are tested at
the end of test_api.py, so the suite starts one server, not two.)"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from ddtree.console.commands import serve

from ....support.server import CLI


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


def test_serve_passes_the_backend_through():
    argv = serve.server_argv(parse("--backend", "fast"))
    assert argv[argv.index("--backend") + 1] == "fast"
    assert "--backend transformers" in " ".join(serve.server_argv(parse("--backend", "transformers")))
    assert "--backend auto" in " ".join(serve.server_argv(parse()))  # the default, said out loud


def test_serve_refuses_an_unknown_backend_in_one_line():
    out = subprocess.run([*CLI, "serve", "--backend", "bogus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "--backend" in out.stderr and "transformers" in out.stderr


def test_warm_up_prints_backend_progress_as_json_lines_before_anything_else(tiny_pair, capsys):
    from ddtree.engine.reference.engine import Engine
    from ddtree.engine.reference.server import warm_up
    from ddtree.engine.reference.api import ServerConfig

    engine = Engine.load(*tiny_pair, backend="fast")
    steps = []

    def capture(progress=None, budgets=()):  # what the fast backend does on CUDA, where it captures graphs
        steps.append("warmup")
        progress("captured CUDA graphs for session slot 1/1")

    engine.warmup = capture
    warm_up(engine, ServerConfig(algorithm="ddtree", budget=4, served_model_name="t", model_path="t",
                                 draft_path="d", max_running=2, max_queued=2, graceful_timeout_s=1.0, batch=True))
    lines = capsys.readouterr().out.splitlines()
    assert steps == ["warmup"]
    assert [json.loads(line) for line in lines] == [
        {"event": "warmup", "message": "captured CUDA graphs for session slot 1/1"}]


@pytest.mark.parametrize("graphs", [False, True])
def test_warm_up_generates_once_per_kind_a_request_may_ask_for_where_graphs_run(graphs, capsys, monkeypatch):
    """With CUDA graphs, ar, dflash and ddtree at each captured budget, besides the default;
    without them (a CPU), the default alone. Then, with graphs, the late-compile watch."""
    from types import SimpleNamespace

    from ddtree.engine.reference.api import ServerConfig
    from ddtree.engine.reference.fast import graphs as graph_module
    from ddtree.engine.reference.server import warm_up

    watched = []
    monkeypatch.setattr(graph_module, "watch_late_compiles", lambda log: watched.append(log) or True)

    ran = []
    engine = SimpleNamespace(
        graphs=graphs, draft_name="d", eos_token_ids=[0],
        tokenizer=SimpleNamespace(encode=lambda text: [1, 2, 3]),
        warmup=lambda progress=None, budgets=(): ran.append(("warmup", budgets)),
        generate=lambda ids, gen, spec: ran.append((spec.algorithm, spec.budget)))
    warm_up(engine, ServerConfig(algorithm="ddtree", budget=16, served_model_name="t", model_path="t",
                                 draft_path="d", capture_budgets=(64, 16)))
    if graphs:
        assert ran == [("warmup", (16, 64)), ("ddtree", 16), ("ar", 16), ("dflash", 16), ("ddtree", 64)]
        messages = [json.loads(line)["message"] for line in capsys.readouterr().out.splitlines()]
        assert messages[-2] == "warmed up ddtree at budget 64 with a generation of 8 tokens"
        assert messages[-1].startswith("from now on, a Triton kernel compiled while serving") and watched
    else:
        assert ran == [("warmup", (16, 64)), ("ddtree", 16)] and not watched


def test_serve_refuses_a_drafter_given_as_the_target_in_one_line():
    from ddtree.engine.demo import demo_paths

    _, drafter = demo_paths()
    out = subprocess.run([*CLI, "serve", "--model", str(drafter)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "is a DFlash drafter, not a target" in out.stderr


def test_warm_up_without_a_tokenizer_generates_from_the_eos_ids():
    """A target folder without tokenizer files serves input_ids only; the warm-up must not need one."""
    from types import SimpleNamespace

    from ddtree.engine.reference.api import ServerConfig
    from ddtree.engine.reference.server import warm_up

    prompts = []
    engine = SimpleNamespace(graphs=False, draft_name=None, eos_token_ids=[7], tokenizer=None,
                             warmup=lambda progress=None, budgets=(): None,
                             generate=lambda ids, gen, spec: prompts.append(ids))
    warm_up(engine, ServerConfig(algorithm="ar", budget=0, served_model_name="t", model_path="t", draft_path=None))
    assert prompts == [[7]]


@pytest.mark.parametrize("argv, says", [
    (["--budget", "-1"], "--budget"), (["--port", "70000"], "--port"), (["--algorithm", "medusa"], "--algorithm"),
    (["--backend", "bogus"], "--backend"), (["--max-queued-requests", "-1"], "--max-queued-requests: must be >= 0"),
    (["--max-running-requests", "0"], "--max-running-requests: must be >= 1"), (["--threads", "0"], "--threads"),
    (["--model", ""], "--model: must name"), (["--draft", " "], "--draft: must name")])
def test_serve_rejects_bad_arguments_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_serve_help_documents_the_options():
    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--draft", "--algorithm", "--budget", "--block-size", "--device", "--host", "--port",
                 "--backend"):
        assert flag in out.stdout
    bad = subprocess.run([*CLI, "serve", "--budget", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--budget" in bad.stderr


@pytest.mark.slow
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


def test_a_cpu_server_leaves_a_core_to_the_http_side(monkeypatch):
    from ddtree.engine.reference.server import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [cpu_threads(parse(), 64, usable=n) for n in (1, 2, 16)] == [1, 1, 15]
    assert cpu_threads(parse(), 8, usable=16) == 8  # 8 cores with 2 hyperthreads each: no more than torch's 8
    assert cpu_threads(parse("--threads", "2"), 2, usable=2) == 2  # the operator's choice wins
    assert cpu_threads(parse("--device", "cuda"), 16, usable=16) is None  # torch's choice on a GPU box
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_threads(parse(), 4, usable=16) is None  # torch reads it itself


def test_a_ready_server_process_keeps_what_lives_then_out_of_later_collections():
    """server.freeze_gc, which the engine process and the HTTP processes call once ready: in a
    process of its own, since what it freezes stays for good."""
    code = ("import gc; from ddtree.engine.reference import server; before = gc.get_freeze_count(); "
            "server.freeze_gc(); print(before, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after = (int(n) for n in out.stdout.split())
    assert before == 0 and after > 10_000  # the server module's imports alone: tens of thousands
