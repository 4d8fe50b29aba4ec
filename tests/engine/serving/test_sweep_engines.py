"""SGLang in the sweep runner: the dry run's exact commands from a probed interpreter (recorded
help of SGLang 0.5.23 and of a DDTree build), refusals with exit 2, and whole sweeps against a
stand-in SGLang server (a real subprocess started by the runner, real HTTP on loopback) that fill
points with per-request and counter-difference acceptance; start failures classified from the
engine's log; a lost port retried; CPUs pinned by the runner when no numactl/taskset exists."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from ddtree.engine.machine.hw import GpuInfo
from ddtree.engine.machine.host import NumaNode
from ddtree.engine.serving.probe import capabilities_from_help
from ddtree.engine.serving.prompts import load_prompts
from ddtree.jobs import plan as plan_module
from ddtree.jobs.plan import Hardware, check_plan, make_plan
from ddtree.jobs.recipe import recipe_from_dict
from ddtree.jobs.supervisor import submit
from ddtree.store import sweeps
from ddtree.store.db import open_db
from ddtree.store.queries import get_job
from .engine_fakes import DIES, STANDIN, ddtree_help, recorded_help

pytestmark = pytest.mark.timeout(120)

PY_RESOLVED = "/opt/sglang/bin/python"
CAPS_0523 = capabilities_from_help("sglang", PY_RESOLVED, "0.5.23", recorded_help("0.5.23"))
CAPS_DDTREE = capabilities_from_help("sglang", PY_RESOLVED, "0.5.23.dev29907", ddtree_help())


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(5)))
    return path


def cli(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), *args],
                          capture_output=True, text=True, timeout=90, env=env)


def write_toml(path, engine: dict, sweep: dict):
    def table(name, values):
        return [f"[{name}]"] + [f"{k} = {json.dumps(v) if not isinstance(v, dict) else inline(v)}"
                                for k, v in values.items()]

    def inline(d):
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + " }"

    path.write_text("\n".join(['name = "sg"'] + table("engine", engine) + table("sweep", sweep)) + "\n")
    return path


# -- the plan and the dry run ----------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_json_gives_the_exact_sglang_commands(fake_python, tmp_path):
    python = fake_python("sglang")  # answers --help with SGLang 0.5.23's recorded help
    recipe = write_toml(tmp_path / "sg.toml", {
        "kind": "sglang", "python": str(python), "model": "Qwen/Qwen3-8B", "draft_model": "z-lab/Qwen3-8B-DFlash-b16",
        "algorithm": "dflash", "block_size": 16, "draft_window": 4096, "gpus": [0, 1, 2, 3],
        "extra_args": ["--attention-backend", "fa3"], "env": {"SGLANG_LOG_LEVEL": "info"}},
        {"tp": [2, 4], "concurrency": [1, 8], "baseline": ["ar"], "num_prompts": 40})
    out = cli(tmp_path, "sweep", str(recipe), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["engine"]["version"] == "0.5.23" and "DFLASH" in plan["engine"]["algorithms"]
    assert [(l["tp"], l["algorithm"]) for l in plan["launches"]] == [(2, "ar"), (2, "dflash"), (4, "ar"), (4, "dflash")]
    ports = set()
    for launch in plan["launches"]:
        assert launch["unsupported"] is None
        argv, tp = launch["argv"], launch["tp"]
        port = argv[argv.index("--port") + 1]
        ports.add(port)
        head = [str(python), "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B", "--tp-size", str(tp)]
        spec = [] if launch["algorithm"] == "ar" else [
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "z-lab/Qwen3-8B-DFlash-b16",
            "--speculative-num-draft-tokens", "16", "--speculative-draft-window-size", "4096"]
        assert argv == head + spec + ["--host", "127.0.0.1", "--port", port, "--enable-metrics",
                                      "--attention-backend", "fa3"]
        gpus = ",".join(str(g) for g in range(tp))
        assert launch["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": gpus,
                                 "SGLANG_LOG_LEVEL": "info"}
        assert shlex.split(launch["command"]) == [f"{k}={v}" for k, v in sorted(launch["env"].items())] + argv
    assert len(ports) == 4 and all(int(p) > 0 for p in ports)
    assert len(plan["points"]) == 8 and not (tmp_path / "d.db").exists()
    # the text dry run prints the same command lines
    text = cli(tmp_path, "sweep", str(recipe), "--dry-run")
    assert text.returncode == 0 and "engine: SGLang 0.5.23" in text.stdout
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1 SGLANG_LOG_LEVEL=info " in text.stdout


@pytest.mark.slow
def test_ddtree_refused_on_0_5_23_with_exit_2_and_accepted_on_a_ddtree_build(fake_python, tmp_path):
    engine = {"kind": "sglang", "model": "Qwen/Qwen3-8B", "draft_model": "z-lab/Qwen3-8B-DFlash-b16",
              "algorithm": "ddtree", "block_size": 16}
    release = write_toml(tmp_path / "rel.toml", {**engine, "python": str(fake_python("sglang"))},
                         {"budget": [16, 64]})
    out = cli(tmp_path, "sweep", str(release), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    launches = json.loads(out.stdout)["launches"]
    assert [l["argv"] for l in launches] == [None, None]
    assert all("this SGLang (0.5.23) has no DDTREE" in l["unsupported"] for l in launches)
    assert "use algorithm dflash, or point engine.python at a DDTree build" in launches[0]["unsupported"]
    real = cli(tmp_path, "sweep", str(release))
    assert real.returncode == 2 and "Traceback" not in real.stderr
    assert real.stderr.strip().startswith("error: sglang launch 0 (ddtree budget 16, tp 1) cannot start")
    assert "has no DDTREE" in real.stderr and len(real.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d.db").exists()  # refused before the store is touched

    build = fake_python("sglang", help_text=ddtree_help(), version="0.5.23.dev29907")
    patched = write_toml(tmp_path / "dd.toml", {**engine, "python": str(build)}, {"budget": [16, 64]})
    out = cli(tmp_path, "sweep", str(patched), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    for launch, budget in zip(json.loads(out.stdout)["launches"], (16, 64)):
        argv = launch["argv"]
        assert launch["unsupported"] is None and launch["budget"] == budget
        assert argv[argv.index("--speculative-algorithm") + 1] == "DDTREE"
        assert argv[argv.index("--speculative-ddtree-budget") + 1] == str(budget)
        assert argv[argv.index("--page-size") + 1] == "1"


def _box(cpu_near_gpu1: int, memory: int | None = None) -> Hardware:
    """Two GPUs on two NUMA nodes (GPU 1 next to `cpu_near_gpu1`)."""
    others = sorted(set(os.sched_getaffinity(0)) - {cpu_near_gpu1})
    gpus = (GpuInfo(index=0, numa_node=0, cpu_affinity=others, memory_total=memory, memory_used=0),
            GpuInfo(index=1, numa_node=1, cpu_affinity=[cpu_near_gpu1], memory_total=memory, memory_used=0))
    return Hardware(gpus=gpus, links=(("X", "SYS"), ("SYS", "X")),
                    numa=(NumaNode(node=0, cpus=others), NumaNode(node=1, cpus=[cpu_near_gpu1])))


def _recipe(**engine):
    table = {"kind": "sglang", "python": PY_RESOLVED, "model": "Qwen/Qwen3-8B", "algorithm": "ar", **engine}
    return recipe_from_dict({"name": "p", "engine": table, "sweep": {"concurrency": 1}})


def test_plan_pins_to_the_gpus_numa_node_and_checks_gpus_and_fit(tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "numactl").write_text("#!/bin/sh\nexec \"$@\"\n")
    (tools / "numactl").chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    plan = make_plan(_recipe(gpus=[1], numa_bind="auto"), hardware=_box(1), caps=CAPS_0523)
    launch = plan.launches[0]
    assert launch.numa == "numactl" and list(launch.argv[:3]) == ["numactl", "--cpunodebind=1", "--membind=1"]
    assert launch.argv[3] == PY_RESOLVED and dict(launch.env)["CUDA_VISIBLE_DEVICES"] == "1"
    # without numactl or taskset the runner pins: the CPUs travel in the launch
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    launch = make_plan(_recipe(gpus=[1], numa_bind="auto"), hardware=_box(1), caps=CAPS_0523).launches[0]
    assert launch.numa == "runner" and launch.cpu_affinity == (1,) and launch.argv[0] == PY_RESOLVED
    # unknown hardware: nothing pinned, and the launch says why
    launch = make_plan(_recipe(gpus=[1], numa_bind="auto"), hardware=None, caps=CAPS_0523).launches[0]
    assert launch.numa == "off" and any("nothing pinned" in n for n in launch.notes)
    # a GPU this machine does not have, a tp that does not divide the GPU set
    bad = make_plan(_recipe(gpus=[0, 5]), hardware=_box(1), caps=CAPS_0523)
    assert "GPU 5 does not exist on this machine" in bad.launches[0].unsupported
    three = recipe_from_dict({"name": "p", "engine": {"kind": "sglang", "python": PY_RESOLVED, "model": "m",
                                                       "algorithm": "ar", "gpus": [0, 1, 2, 3]},
                              "sweep": {"tp": [2, 3]}})
    plan = make_plan(three, caps=CAPS_0523)
    assert plan.launches[0].unsupported is None and "tp 3 does not divide the 4 GPUs" in plan.launches[1].unsupported
    with pytest.raises(plan_module.UnsupportedEngine) as info:
        check_plan(plan)
    assert info.value.exit_code == 2 and "launch 1 (ar, tp 3)" in str(info.value)
    # weights that do not fit one 80 GB GPU (a sparse file: no disk used)
    model = tmp_path / "big"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as fh:
        fh.truncate(150 * 10**9)
    plan = make_plan(_recipe(model=str(model), gpus=[1]), hardware=_box(1, memory=80 * 10**9), caps=CAPS_0523)
    assert "does not fit" in plan.launches[0].unsupported and "use tp 4" in plan.launches[0].unsupported


def test_recipe_draft_window_reaches_the_command_and_bad_flags_are_named():
    launch = make_plan(_recipe(algorithm="dflash", draft_model="d", draft_window=1024), caps=CAPS_0523).launches[0]
    assert launch.argv[launch.argv.index("--speculative-draft-window-size") + 1] == "1024"
    bad = make_plan(_recipe(extra_args=["--no-such-flag"]), caps=CAPS_0523).launches[0]
    assert bad.argv is None and "--no-such-flag is not accepted by SGLang 0.5.23" in bad.unsupported
    assert make_plan(_recipe(algorithm="ddtree", draft_model="d", budget=8), caps=CAPS_DDTREE).launches[0].unsupported \
        is None


# -- whole sweeps against the stand-in ---------------------------------------------------------


def _run(tmp_path, recipe: dict):
    db_path = tmp_path / "d.db"
    job_id = submit(db_path, "sweep", {"recipe": recipe}, detach=False)
    db = open_db(db_path)
    job = get_job(db, job_id)
    run_id = db.execute("SELECT id FROM runs WHERE job_id = ?", [job_id]).fetchone()[0]
    points = {p.id: p for p in sweeps.list_points(db, run_id)}
    extra = {row[0]: (row[1], json.loads(row[2]) if row[2] else None)
             for row in db.execute("SELECT id, tau_counters, accept_counters FROM points WHERE run_id = ?", [run_id])}
    engines = [dict(zip(("state", "port", "base_url", "pid", "log_path", "error", "algorithm"), row)) for row in
               db.execute("SELECT state, port, base_url, pid, log_path, error, algorithm FROM engines "
                          "WHERE job_id = ? ORDER BY id", [job_id])]
    db.close()
    return job, list(points.values()), extra, engines


def _standin_recipe(python, prompts, **engine):
    warm = load_prompts(str(prompts), 1, seed=0, offset=4)[0].text
    table = {"kind": "sglang", "python": str(python), "model": "/models/demo-target", "algorithm": "dflash",
             "draft_model": "/models/demo-dflash", "block_size": 8, "draft_window": 256, "ready_timeout_s": 30.0,
             "env": {"STANDIN_WARM": warm}, **engine}
    return {"name": "standin", "engine": table,
            "sweep": {"concurrency": [1, 2], "dataset": str(prompts), "num_prompts": 4, "max_new_tokens": 16,
                      "warmup": 1, "baseline": ["ar"], "timeout_s": 30.0}}


@pytest.mark.slow
def test_sweep_on_a_standin_sglang_fills_points_with_counter_difference_tau(fake_python, tmp_path, prompts):
    python = fake_python("sglang", server_body=STANDIN)
    job, points, extra, engines = _run(tmp_path, _standin_recipe(python, prompts))
    assert job.state == "succeeded", job.error
    assert [(p.algorithm, p.concurrency, p.state) for p in points] == [
        ("ar", 1, "done"), ("ar", 2, "done"), ("dflash", 1, "done"), ("dflash", 2, "done")]
    for p in points:
        tau, counters = extra[p.id]
        assert p.requests_ok == 4 and p.requests_failed == 0 and p.output_tok_s > 0
        if p.algorithm == "ar":
            assert tau is None and p.tau_weighted is None  # nothing verified: no acceptance
            assert counters["verify_calls"] == 0 and counters["generated_tokens"] == 64
        else:
            # 64 tokens in 16 verify rounds: the counters' difference over the measured requests only
            # (with the warm-up it would be 80/24; since boot, about 1.1)
            assert tau == pytest.approx(4.0) and counters["requests"] == 4 and counters["verify_calls"] == 16
            assert p.tau_weighted == pytest.approx(4.0) and p.tau_mean == pytest.approx(4.0)
            assert p.tau_hist == [0, 0, 0, 0, 16]  # SGLang's correct-drafts histogram, shifted to accept length
            assert p.speedup_vs_ar is not None
    assert [e["state"] for e in engines] == ["stopped", "stopped"] and [e["algorithm"] for e in engines] == ["ar", "dflash"]
    assert len({e["port"] for e in engines}) == 2 and all(e["base_url"].endswith(f":{e['port']}") for e in engines)
    for e in engines:
        with pytest.raises(ProcessLookupError):
            os.kill(e["pid"], 0)  # stopped and reaped
    args = json.loads(next(line for line in open(engines[1]["log_path"]) if line.startswith("server_args="))[12:])
    assert args["speculative_algorithm"] == "DFLASH" and args["speculative_num_draft_tokens"] == 8
    assert args["speculative_draft_window_size"] == 256 and args["enable_metrics"] and args["port"] == engines[1]["port"]


def test_engine_start_failure_is_classified_from_its_log(fake_python, tmp_path, prompts):
    python = fake_python("sglang", server_body=DIES)
    recipe = _standin_recipe(python, prompts)
    del recipe["sweep"]["baseline"]
    recipe["sweep"].update(concurrency=[1])
    job, points, _, engines = _run(tmp_path, recipe)
    assert job.state == "failed" and "CUDA out of memory: torch.OutOfMemoryError" in job.error
    (point,) = points
    assert point.state == "failed"
    assert point.error.startswith("engine failed to start: CUDA out of memory: torch.OutOfMemoryError: CUDA out of")
    assert [e["state"] for e in engines] == ["failed"] and engines[0]["error"].startswith("CUDA out of memory")


def test_port_lost_to_a_race_is_retried_on_another_port(fake_python, tmp_path, prompts):
    python = fake_python("sglang", server_body=STANDIN)
    recipe = _standin_recipe(python, prompts)
    recipe["engine"]["env"]["STANDIN_FAIL_ONCE"] = str(tmp_path / "failed-once")
    del recipe["sweep"]["baseline"]
    recipe["sweep"].update(concurrency=[1], warmup=0)
    job, points, _, engines = _run(tmp_path, recipe)
    assert job.state == "succeeded" and [p.state for p in points] == ["done"]
    assert [e["state"] for e in engines] == ["failed", "stopped"] and engines[0]["error"].startswith("port in use")
    assert engines[0]["port"] != engines[1]["port"]


def test_runner_pins_cpus_when_neither_numactl_nor_taskset_exists(fake_python, tmp_path, prompts, monkeypatch):
    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setattr(plan_module.Hardware, "detect", classmethod(lambda cls: _box(cpu)))
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    python = fake_python("sglang", server_body=STANDIN)
    recipe = _standin_recipe(python, prompts, algorithm="ar", gpus=[1], numa_bind="auto")
    del recipe["engine"]["draft_window"]
    del recipe["sweep"]["baseline"]
    recipe["sweep"].update(concurrency=[1], warmup=0, num_prompts=2)
    job, points, _, engines = _run(tmp_path, recipe)
    assert job.state == "succeeded" and [p.state for p in points] == ["done"]
    log = open(engines[0]["log_path"]).read()
    assert f"affinity=[{cpu}]" in log and "cuda_visible_devices=1" in log
    assert "by the runner (no numactl or taskset)" in open(job.log_path).read()


# vLLM's OpenAI server, as far as the runner and the bench client use it: streamed completions
# with usage, and the spec-decode counters (each draft round proposes 7 tokens and accepts 3 here).
VLLM_HELP = ("usage: vllm serve [model_tag] [options]\n\noptions:\n  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp "
             "TENSOR_PARALLEL_SIZE\n  --host HOST\n  --port PORT\n  --speculative-config SPECULATIVE_CONFIG, -sc "
             "SPECULATIVE_CONFIG\n")
VLLM_STANDIN = r'''
import argparse, json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
p = argparse.ArgumentParser()
p.add_argument("command", choices=["serve"]); p.add_argument("model")
p.add_argument("--tensor-parallel-size", type=int); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--speculative-config", type=json.loads)
args = p.parse_args()
print("server_args=" + json.dumps(vars(args)), flush=True)
k = (args.speculative_config or {}).get("num_speculative_tokens", 0)
state = {"drafts": 30, "draft_tokens": 30 * k, "accepted": 0, "tokens": 500}
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/health":
            body, ctype = b"", "application/json"
        elif self.path == "/metrics":
            with lock:
                body = "".join(f"vllm:{name}{{model_name=\"m\"}} {value}.0\n" for name, value in (
                    ("spec_decode_num_drafts_total", state["drafts"]),
                    ("spec_decode_num_draft_tokens_total", state["draft_tokens"]),
                    ("spec_decode_num_accepted_tokens_total", state["accepted"]),
                    ("generation_tokens_total", state["tokens"]))).encode()
            ctype = "text/plain"
        else:
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers(); return
        self.send_response(200); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and body["model"] == args.model and body["stream"]
        n = body["max_tokens"]
        rounds = -(-n // 4) if k else 0
        with lock:
            state["drafts"] += rounds; state["draft_tokens"] += rounds * k
            state["accepted"] += rounds * 3; state["tokens"] += n
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close"); self.end_headers()
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True

ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''


@pytest.mark.slow
def test_sweep_on_a_standin_vllm_measures_tau_from_its_spec_decode_counters(fake_python, tmp_path, prompts):
    python = fake_python("vllm", help_text=VLLM_HELP, version="0.33.0", server_body=VLLM_STANDIN)
    recipe = _standin_recipe(python, prompts, kind="vllm")
    del recipe["engine"]["draft_window"]
    job, points, extra, engines = _run(tmp_path, recipe)
    assert job.state == "succeeded", job.error
    assert [(p.algorithm, p.concurrency, p.state) for p in points] == [
        ("ar", 1, "done"), ("ar", 2, "done"), ("dflash", 1, "done"), ("dflash", 2, "done")]
    for p in points:
        tau, counters = extra[p.id]
        assert p.requests_ok == 4 and p.output_tok_s > 0 and p.ttft_p50 is not None
        if p.algorithm == "dflash":
            # 4 requests x 4 rounds, 3 of 7 drafts accepted per round: tau = 1 + 48/16
            assert tau == pytest.approx(4.0) and counters["verify_calls"] == 16
            assert counters["accept_rate"] == pytest.approx(3 / 7)
        else:
            assert tau is None
    args = json.loads(next(line for line in open(engines[1]["log_path"]) if line.startswith("server_args="))[12:])
    assert args["speculative_config"] == {"method": "dflash", "model": "/models/demo-dflash",
                                          "num_speculative_tokens": 7}
