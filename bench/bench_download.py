"""Download throughput: our `download` path vs huggingface_hub's own `hf download`, same local hub.

    .venv/bin/python bench/bench_download.py [--files 4] [--mb 512] [--rounds 3] [--max-workers 8]

Generates FILES x MB of incompressible files in a temp folder (checks free space first, deletes
everything at the end), serves them with tests/engine/machine/download/hub_server.py in its own process on a free
loopback port (no throttle), then alternates, round by round, between
  (a) ours:  `ddtree-console --db TMP download REPO --local-dir DIR --max-workers N` (foreground job:
      preflight, job row, runner, progress in the store), and
  (b) hf:    `hf download REPO --local-dir DIR --max-workers N` (huggingface_hub's CLI),
and (c) lib: the same plan + Download the job runs, in a bare `python -c` (no CLI, store or runner),
each into a fresh folder that is removed after the round. First each command fetches a one-file repo
five times: its fixed cost (start-up, imports, listing, the store), reported apart. Wall time of the whole command is what a
user waits for; MB/s = bytes / wall time. Prints medians and the ratio ours/hf (target: >= 0.95), and each client's
own CPU time (user + sys), which other load on the box does not inflate.

Measured 2026-11-29 on the shared 2-core dev box (4 x 512 MB, 8 workers, 5 rounds + 1 warm-up;
other jobs were running, single rounds ranged 12-37 s): median ours 133.5 MB/s, lib 137.0, hf 130.3;
ours/hf 1.024, lib/hf 1.051. Earlier runs of the same script under heavier load gave 0.89 and 0.78:
wall medians here swing more than the 5% target, so read the CPU and fixed-cost lines too. Those are
stable: the transfer itself costs the same CPU (lib 11.4 s vs hf 12.2 s for 2.1 GB), and with the
hub throttled to 5 MB/s for 20 s the job machinery (store rows, heartbeat, progress printer) added
0.1 s CPU over the library path; ours pays about 1.1-1.3 s more fixed start-up than `hf download`
(CLI imports, the store, the listing done by the CLI's preflight and again by the job).
The order inside a round alternates too, so page-cache and disk write-back effects do not favour one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
HUB = ROOT / "tests" / "engine" / "machine" / "download" / "hub_server.py"
REPO = "bench/blob"
TINY = "bench/tiny"
# What the download job runs, minus the CLI, the store and the job runner.
LIB = ("import sys; from ddtree.engine.machine.download import Download, DownloadSpec, plan; "
       "Download(plan(DownloadSpec(repo_id=sys.argv[1], local_dir=sys.argv[2], max_workers=int(sys.argv[3])))).run()")


def make_files(folder: Path, count: int, mb: int) -> int:
    block = os.urandom(1 << 20)
    for i in range(count):
        with open(folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors", "wb") as f:
            for j in range(mb):
                # vary each MB cheaply so no layer can dedupe or compress the stream
                f.write(j.to_bytes(8, "little") + block[8:])
    (folder / "config.json").write_text(json.dumps({"model_type": "bench"}))
    return sum(p.stat().st_size for p in folder.iterdir())


def start_hub(src: Path, tiny: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(HUB), "--repo", f"{REPO}={src}", "--repo", f"{TINY}={tiny}"],
                            stdout=subprocess.PIPE,
                            stderr=open(log, "wb"), start_new_session=True, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"hub did not start; see {log}")
    return proc, json.loads(line)["url"]


def timed(argv: list[str], env: dict, log: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys) of the client process; the CPU time is what the
    client itself costs, unaffected by other load on the box."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        rc = subprocess.run(argv, env=env, stdout=out, stderr=out, start_new_session=True).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise SystemExit(f"{argv[0]} exited {rc}; see {log}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def check_complete(dest: Path, src: Path) -> None:
    for p in src.iterdir():
        got = dest / p.name
        if not got.is_file() or got.stat().st_size != p.stat().st_size:
            raise SystemExit(f"incomplete download: {got}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (page cache, write-back)")
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    args = ap.parse_args(argv)

    total_mb = args.files * args.mb
    # the source plus one copy at a time, plus room so our reserve check (10 GB floor) passes
    need = 2 * total_mb * 1_000_000 + 1_000_000_000
    work = Path(tempfile.mkdtemp(prefix="ddtree-bench-dl-", dir=args.dir))
    free = shutil.disk_usage(work).free
    if free < need + 12_000_000_000:
        shutil.rmtree(work)
        raise SystemExit(f"not enough disk: {free / 1e9:.1f} GB free, need {(need + 12e9) / 1e9:.1f} GB")
    hub = None
    try:
        src = work / "src"
        src.mkdir()
        size = make_files(src, args.files, args.mb)
        tiny = work / "tiny"
        tiny.mkdir()
        (tiny / "config.json").write_text("{}")
        hub, url = start_hub(src, tiny, work / "hub.log")
        env = dict(os.environ, HF_ENDPOINT=url, HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   DDTREE_DB=str(work / "ddtree.db"))
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_XET_HIGH_PERFORMANCE"):
            env.pop(name, None)
        n = str(args.max_workers)
        commands = {
            "ours": lambda repo, d: [str(VENV_BIN / "ddtree-console"), "--db", str(work / "ddtree.db"), "download",
                                     repo, "--local-dir", str(d), "--max-workers", n],
            "lib": lambda repo, d: [sys.executable, "-c", LIB, repo, str(d), n],
            "hf": lambda repo, d: [str(VENV_BIN / "hf"), "download", repo, "--local-dir", str(d), "--max-workers", n],
        }
        # fixed cost of each command (start-up, imports, listing, store): a one-file repo
        fixed = {}
        for name, argv in commands.items():
            runs = [timed(argv(TINY, work / f"tiny-{name}-{i}"), env, work / f"{name}.log") for i in range(5)]
            fixed[name] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        print("fixed cost (one tiny file, median of 5): " + ", ".join(
            f"{k} {w:.2f} s wall / {c:.2f} s CPU" for k, (w, c) in fixed.items()), flush=True)
        times: dict[str, list[float]] = {k: [] for k in commands}
        cpu: dict[str, list[float]] = {k: [] for k in commands}
        print(f"{args.files} x {args.mb} MB ({size / 1e6:.0f} MB) from {url}, max workers {n}, "
              f"{args.rounds} rounds", flush=True)
        for r in range(-args.warmup, args.rounds):
            names = list(commands)
            k = r % len(names)
            order = names[k:] + names[:k]  # rotate: each client goes first, middle and last in turn
            for name in order:
                dest = work / f"dst-{name}-{r}"
                subprocess.run(["sync"], check=False)
                wall, cpu_s = timed(commands[name](REPO, dest), env, work / f"{name}.log")
                check_complete(dest, src)
                label = f"round {r + 1}" if r >= 0 else "warm-up"
                if r >= 0:
                    times[name].append(wall)
                    cpu[name].append(cpu_s)
                print(f"{label:8s} {name:4s} {wall:6.2f} s  {size / 1e6 / wall:7.1f} MB/s  client CPU {cpu_s:5.2f} s",
                      flush=True)
                shutil.rmtree(dest)
        med = {k: statistics.median(v) for k, v in times.items()}
        rate = {k: size / 1e6 / t for k, t in med.items()}
        print("median " + ", ".join(f"{k} {rate[k]:.1f} MB/s ({med[k]:.2f} s)" for k in commands))
        print("median client CPU " + ", ".join(f"{k} {statistics.median(cpu[k]):.2f} s" for k in commands))
        print(f"ours/hf = {rate['ours'] / rate['hf']:.3f}, lib/hf = {rate['lib'] / rate['hf']:.3f}")
        # per-round ratios of neighbours in time are less exposed to load drifting over the run
        pair = [h / o for o, h in zip(times["ours"], times["hf"])]
        print(f"median per-round ours/hf = {statistics.median(pair):.3f}; "
              f"without the fixed-cost difference: ours/hf = "
              f"{(med['hf'] - fixed['hf'][0]) / (med['ours'] - fixed['ours'][0]):.3f}")
    finally:
        if hub is not None:
            hub.terminate()
            try:
                hub.wait(timeout=5)
            except subprocess.TimeoutExpired:
                hub.kill()
                hub.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
