"""`ddtree-console download`: dry run, refusal with the numbers, foreground run, bad input as one line."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from ddtree.console.commands import download as dl_cmd
from ddtree.engine.errors import EngineError
from ddtree.jobs.errors import JobError
from ddtree.store.db import open_db


def run_dl(argv: list[str], db: Path) -> tuple[int, str, str]:
    """Parse and run like the CLI main does: our errors become one `error: ...` line."""
    parser = argparse.ArgumentParser(prog="ddtree-console")
    parser.add_argument("--db")
    dl_cmd.add_parser(parser.add_subparsers(dest="command"))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            args = parser.parse_args(["--db", str(db), "download", *argv])
            rc = dl_cmd.run(args)
        except (EngineError, JobError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            rc = exc.exit_code
        except SystemExit as exc:  # argparse's own usage errors
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def env(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    # huggingface_hub read HF_ENDPOINT at import; the commands pass no endpoint, so point its constant too
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    return tmp_path / "ddtree.db"


def test_dry_run_lists_files_and_fetches_nothing(hub, tmp_path, env):
    rc, out, err = run_dl(["acme/tiny", "--include", "*.safetensors", "--local-dir", str(tmp_path / "m"),
                           "--reserve-gb", "0", "--dry-run"], env)
    assert rc == 0, err
    assert "2 of 5 files, 500.0 kB; to fetch: 2 files, 500.0 kB" in out and "fits" in out
    assert "fetch   300.0 kB  model-00001-of-00002.safetensors" in out
    assert not [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    rc, out, _ = run_dl(["acme/tiny", "--dry-run", "--json", "--reserve-gb", "0",
                         "--local-dir", str(tmp_path / "m")], env)
    plan = json.loads(out)
    assert rc == 0 and plan["files_total"] == 5 and plan["disk"]["ok"] is True


def test_refusal_prints_the_numbers(hub, tmp_path, env):
    free = shutil.disk_usage(tmp_path).free
    reserve_gb = free / 1e9 + 1  # a reserve above the free space: nothing can fit
    rc, out, err = run_dl(["acme/tiny", "--local-dir", str(tmp_path / "m"), "--reserve-gb", f"{reserve_gb:.3f}"], env)
    assert rc == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: will not fit: needs 550.0 kB,") and "short by" in line and "--reserve-gb" in line
    assert "does NOT fit" in out
    assert not (tmp_path / "m").exists() and not Path(env).exists()  # no job, no byte


def test_foreground_download(hub, tmp_path, env):
    rc, out, err = run_dl(["acme/tiny", "--local-dir", str(tmp_path / "m"), "--reserve-gb", "0"], env)
    assert rc == 0, err
    assert f"done: {(tmp_path / 'm').resolve()}" in out
    # the progress line drawn last is the final state, not whatever the last poll caught
    assert err.strip().splitlines()[-1].startswith("[" + "#" * 28 + "] 100.0% 550.0 kB/550.0 kB files 5/5"), err
    assert (tmp_path / "m/sub/extra.bin").stat().st_size == 50_000
    db = open_db(env)
    row = next(db["downloads"].rows)
    assert row["state"] == "succeeded" and row["files_done"] == 5
    db.close()


def test_foreground_json_holds_the_plan_as_help_says(hub, tmp_path, env):
    """`--json` is documented as "print the plan (and the job id)"; in the foreground it printed
    the job's outcome alone."""
    rc, out, err = run_dl(["acme/tiny", "--local-dir", str(tmp_path / "m"), "--reserve-gb", "0", "--json"], env)
    assert rc == 0, err
    got = json.loads(out)
    assert got["state"] == "succeeded" and isinstance(got["job_id"], int)
    assert got["plan"]["files_total"] == 5 and got["plan"]["files_needed"] == 5 and got["plan"]["disk"]["ok"]


@pytest.mark.parametrize("columns", [80, 120])
def test_tty_bar_fits_the_terminal(columns):
    """The bar was padded to 100 columns: in an 80-column terminal each redraw wrapped and
    scrolled a new line instead of overwriting the last."""
    row = {"bytes_total": 80_000_000, "bytes_done": 21_000_000, "files_done": 1, "files_total": 3,
           "rate_bps": 3_700_000.0, "eta_s": 16.0, "disk_free_bytes": 26_100_000_000, "state": "stalled"}
    frame = dl_cmd.tty_frame(dl_cmd._bar(row), columns)
    assert frame.startswith("\r[#######") and "\n" not in frame
    assert len(frame) - 1 < columns  # the cursor never reaches the last column, so nothing wraps


@pytest.mark.parametrize("argv, code, words", [
    (["acme/nope", "--dry-run"], 2, "error: repository acme/nope not found"),
    (["acme/tiny", "--revision", "nope", "--dry-run"], 2, "error: revision 'nope' not found in acme/tiny"),
    (["acme/tiny", "--include", "*.gguf", "--dry-run"], 2, "error: no file of acme/tiny matches the globs"),
    (["acme/tiny", "--include", "../*", "--dry-run"], 2, "error: bad glob: '../*'"),
    (["not a repo"], 2, "error: not a Hugging Face repo id: 'not a repo'"),
    (["acme/tiny", "--reserve-gb", "-1"], 2, "argument --reserve-gb"),
    (["acme/tiny", "--max-workers", "0"], 2, "argument --max-workers: must be 1..64, got 0"),
    # an empty folder name is a slip, not "here": the plan and the "done" check once read it two ways
    (["acme/tiny", "--local-dir", "", "--dry-run"], 2, "error: --local-dir needs a folder name, got ''"),
    (["acme/tiny", "--local-dir", " ", "--dry-run"], 2, "error: --local-dir needs a folder name, got ' '"),
])
def test_bad_input_is_one_line(hub, env, argv, code, words):
    rc, out, err = run_dl(argv, env)
    assert rc == code and words in err and "Traceback" not in err


@pytest.mark.slow
def test_real_cli_entry_point(hub, tmp_path):
    """Through the installed CLI main."""
    probe = subprocess.run([sys.executable, "-m", "ddtree.console.cli", "download", "--help"],
                           capture_output=True, text=True)
    assert probe.returncode == 0 and "REPO_ID" in probe.stdout
    env = {**__import__("os").environ, "HF_ENDPOINT": hub.url}
    res = subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), "download",
                          "acme/nope", "--dry-run"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and res.stderr.startswith("error: repository acme/nope not found")
    assert "Traceback" not in res.stderr


def test_a_second_download_of_the_same_repo_says_it_shares_the_files(hub, tmp_path, env):
    """Two downloads into one place fetch a file once, the second waiting on huggingface_hub's
    lock: it says so instead of sitting at 0 B/s unexplained."""
    from ddtree.jobs import cancel, submit

    hub.rate_bps = 2_000  # the first download stays open while the second looks
    target = str((tmp_path / "m").resolve())
    first = submit(env, "download", {"repo_id": "acme/tiny", "local_dir": target, "reserve_bytes": 0,
                                     "endpoint": hub.url})
    with open_db(env) as db:
        for _ in range(600):
            row = next(db["downloads"].rows_where("job_id = ?", [first]), None)
            if row and row["state"] == "running":
                break
            time.sleep(0.1)
    try:
        rc, _, err = run_dl(["acme/tiny", "--local-dir", target, "--reserve-gb", "0", "--dry-run"], env)
        assert rc == 0 and f"note: job {first} is fetching the same repo into the same place" in err, err
        rc, _, err = run_dl(["acme/tiny", "--reserve-gb", "0", "--dry-run"], env)  # the cache: another place
        assert rc == 0 and "note:" not in err, err
    finally:
        hub.rate_bps = None
        cancel(env, first, grace_s=10)


def test_offline_dry_run_shows_the_copy_on_disk(hub, tmp_path, env, monkeypatch):
    from huggingface_hub import constants

    target = str(tmp_path / "m")
    assert run_dl(["acme/tiny", "--local-dir", target, "--reserve-gb", "0"], env)[0] == 0
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    rc, out, err = run_dl(["acme/tiny", "--local-dir", target, "--reserve-gb", "0", "--dry-run"], env)
    assert rc == 0, err
    assert "to fetch: 0 files" in out and "hub unreachable: this is the copy on disk" in out
    rc, out, err = run_dl(["acme/tiny", "--local-dir", target, "--reserve-gb", "0"], env)  # and a run is done at once
    assert rc == 0 and "done:" in out, err
