"""The builtin server's command line, built once (launch.builtin_argv) and declared once
(launch.add_builtin_options): what every caller builds, the server's own parser reads back."""

import argparse

import pytest

from ddtree.engine.serving.launch import BUILTIN_MODULE, add_builtin_options, builtin_argv


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_builtin_options(p, passthrough=True)
    return p


def test_the_argv_reads_back_through_the_servers_own_parser():
    server = pytest.importorskip("ddtree.engine.reference.server")
    argv = builtin_argv(python="/py", model="/m", draft="/d", algorithm="dflash", budget=None, block_size=8,
                        device="cuda:1", backend="fast", port=0, dtype="bfloat16", max_running_requests=4,
                        batch=False, stream_interval=4, max_prefill_tokens=4096, tokenizer_worker_num=3)
    assert argv[:3] == ["/py", "-m", BUILTIN_MODULE] == ["/py", "-m", server.__name__]
    args = server.build_parser().parse_args(argv[3:])
    assert (args.model, args.draft, args.algorithm, args.budget, args.block_size) == ("/m", "/d", "dflash", None, 8)
    assert (args.device, args.backend, args.host, args.port, args.dtype) == ("cuda:1", "fast", "127.0.0.1", 0, "bfloat16")
    assert (args.max_running_requests, args.max_queued_requests, args.batch) == (4, 64, False)
    assert args.stream_interval == 4 and args.max_prefill_tokens == 4096 and args.tokenizer_worker_num == 3
    assert server.build_parser().parse_args([]).max_prefill_tokens == 16384  # SGLang's default


def test_serve_passes_on_only_what_was_given():
    args = serve_parser().parse_args([])
    assert (args.dtype, args.max_running_requests, args.max_queued_requests, args.threads, args.batch) == (None,) * 5
    argv = builtin_argv(**{k.replace("-", "_"): v for k, v in vars(args).items() if k != "draft"}, draft=args.draft)
    assert "--dtype" not in argv and "--max-running-requests" not in argv and "--batch" not in argv
    assert "--stream-interval" not in argv and "--max-prefill-tokens" not in argv
    assert "--tokenizer-worker-num" not in argv
    assert argv[argv.index("--backend") + 1] == "auto" and argv[argv.index("--port") + 1] == "0"


@pytest.mark.parametrize("flag, value", [("--device", "gpu0"), ("--port", "70000"), ("--budget", "-1"),
                                        ("--stream-interval", "0"), ("--max-prefill-tokens", "0"),
                                        ("--tokenizer-worker-num", "0"), ("--tokenizer-worker-num", "33")])
def test_serve_checks_values_as_it_parses(flag, value):
    with pytest.raises(SystemExit):
        serve_parser().parse_args([flag, value])


def test_mixed_chunks_pass_on_when_asked():
    args = serve_parser().parse_args(["--enable-mixed-chunk", "--chunked-prefill-size", "64"])
    argv = builtin_argv(**{k.replace("-", "_"): v for k, v in vars(args).items() if k != "draft"}, draft=args.draft)
    assert "--enable-mixed-chunk" in argv and argv[argv.index("--chunked-prefill-size") + 1] == "64"
    assert "--incremental-streaming-output" not in argv
    args = serve_parser().parse_args(["--incremental-streaming-output"])
    argv = builtin_argv(**{k.replace("-", "_"): v for k, v in vars(args).items() if k != "draft"}, draft=args.draft)
    assert "--incremental-streaming-output" in argv
    assert "--enable-mixed-chunk" not in builtin_argv()


def test_the_overlap_schedule_turns_off_when_asked():
    """SGLang's flag of that name (its 0.5.23 help lists it), for the builtin server's rounds
    run ahead (fast/batch_graph.py)."""
    assert "--disable-overlap-schedule" not in builtin_argv()
    args = serve_parser().parse_args(["--disable-overlap-schedule"])
    argv = builtin_argv(**{k.replace("-", "_"): v for k, v in vars(args).items() if k != "draft"}, draft=args.draft)
    assert "--disable-overlap-schedule" in argv
    from ddtree.engine.reference import server

    assert server.build_parser().parse_args(argv[3:]).disable_overlap_schedule
    assert not server.build_parser().parse_args([]).disable_overlap_schedule
