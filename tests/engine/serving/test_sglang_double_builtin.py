"""An end-to-end launch where the "SGLang interpreter" is a test double that runs our builtin server.

The double is a real python whose `sglang.launch_server` prints SGLang 0.5.23's recorded help for the
probe and otherwise translates the SGLang command line we built into the builtin server's, on the
demo pair. So the sweep's SGLang path (probe, launch command, readiness, /metrics counter
differences, per-request meta_info, teardown) runs against a real engine with a trained drafter."""

from __future__ import annotations

import time

import pytest
from .test_sweep_engines import _run

from ddtree.engine.demo import demo_paths

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

BUILTIN_BEHIND_SGLANG = r'''
import argparse, os, sys
p = argparse.ArgumentParser()
for flag in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--host", "--port",
             "--speculative-num-draft-tokens", "--speculative-dflash-block-size"):
    p.add_argument(flag)
args, _unused = p.parse_known_args()
algorithm = {None: "ar", "DFLASH": "dflash", "DDTREE": "ddtree"}[args.speculative_algorithm]
argv = [sys.executable, "-m", "ddtree.engine.reference.server", "--model", args.model_path,
        "--algorithm", algorithm, "--host", args.host, "--port", args.port, "--threads", "1"]
if args.speculative_draft_model_path:
    argv += ["--draft", args.speculative_draft_model_path]
block = args.speculative_num_draft_tokens or args.speculative_dflash_block_size
if block:
    argv += ["--block-size", block]
print("builtin behind sglang:", " ".join(argv), flush=True)
os.execv(sys.executable, argv)
'''


def test_sglang_recipe_runs_against_the_builtin_server_behind_a_double(fake_python, tmp_path):
    target, drafter = demo_paths()
    python = fake_python("sglang", server_body=BUILTIN_BEHIND_SGLANG)
    recipe = {"name": "sglang-double", "engine": {
        "kind": "sglang", "python": str(python), "model": str(target), "draft_model": str(drafter),
        "algorithm": "dflash", "block_size": 16, "ready_timeout_s": 120.0},
        "sweep": {"concurrency": [1], "dataset": "builtin:code", "num_prompts": 3, "max_new_tokens": 16,
                  "warmup": 1, "baseline": ["ar"], "timeout_s": 60.0}}
    job, points, extra, engines = _run(tmp_path, recipe)
    assert job.state == "succeeded", job.error
    assert [(p.algorithm, p.state, p.error) for p in points] == [("ar", "done", None), ("dflash", "done", None)]
    for p in points:
        tau, counters = extra[p.id]
        assert p.requests_ok == 3 and p.requests_failed == 0 and p.output_tok_s > 0
        if p.algorithm == "ar":
            assert tau is None and p.tau_weighted is None and counters["verify_calls"] == 0
        else:  # the trained drafter's acceptance, the same from counters and from meta_info
            assert 1.3 < tau <= 16 and tau == pytest.approx(p.tau_weighted, rel=0.05)
            assert p.speedup_vs_ar is not None
    assert [e["state"] for e in engines] == ["stopped", "stopped"]


def test_engine_job_starts_and_stops_an_sglang_server(fake_python, tmp_path):
    """The Engines pane's `engine` job with kind sglang: launched from the probed flags, ready on
    /health, recorded in the engines row, and stopped (group reaped) on cancel."""
    import httpx

    from ddtree.jobs.supervisor import cancel, submit
    from ddtree.store.db import open_db

    target, drafter = demo_paths()
    python = fake_python("sglang", server_body=BUILTIN_BEHIND_SGLANG)
    db_path = tmp_path / "e.db"
    job_id = submit(db_path, "engine", {"kind": "sglang", "python": str(python), "model": str(target),
                                        "draft_model": str(drafter), "algorithm": "dflash", "block_size": 16,
                                        "gpus": [], "ready_timeout_s": 120.0}, detach=True)
    db = open_db(db_path)
    deadline = time.monotonic() + 150
    row = None
    while time.monotonic() < deadline:
        row = db.execute("SELECT state, base_url, error FROM engines WHERE job_id = ?", [job_id]).fetchone()
        if row and row[0] in ("running", "failed"):
            break
        time.sleep(0.5)
    assert row is not None and row[0] == "running", row
    assert httpx.get(row[1] + "/health", timeout=5).status_code == 200
    cancel(db_path, job_id, grace_s=10)
    assert db.execute("SELECT state FROM engines WHERE job_id = ?", [job_id]).fetchone()[0] == "stopped"
    with pytest.raises(httpx.HTTPError):
        httpx.get(row[1] + "/health", timeout=2)
    db.close()
