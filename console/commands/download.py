"""`ddtree-console download REPO_ID [--revision R] [--include GLOB] [--exclude GLOB] [--local-dir DIR]
[--reserve-gb G] [--dry-run] [--detach] [--json]`.

Preflight first, here, before any byte: the repo listing at the revision, the globs applied, what is
already on disk, and the free space on the target filesystem against the reserve (default
max(5% of the disk, 10 GB)). A download that will not fit is refused with the numbers. Then it runs
as a `download` job: in the foreground with a progress bar (Ctrl-C cancels; rerun to resume), or
with --detach as a detached job that survives the terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from ddtree.console.commands import number
from ddtree.engine.machine.download import DownloadPlan, DownloadSpec, plan, progress_line, require_space
from ddtree.engine.units import fmt_bytes
from ddtree.jobs import submit
from ddtree.jobs.errors import JobError
from ddtree.jobs.kinds.download import sharing_note, validate
from ddtree.store.db import open_db, resolve_db_path
from ddtree.store.downloads import download_of_runner, open_downloads_of
from ddtree.store.queries import get_job

BAR_WIDTH = 28


class DownloadJobFailed(JobError):
    pass


def _reserve_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GB, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"the reserve must be a finite number >= 0, got {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("download", help="download a model from the Hugging Face Hub (with disk headroom)",
                              description="Download a Hugging Face repo into the HF cache or a folder. Refuses "
                                          "before any byte when the files would leave less than the reserve free, "
                                          "and stops if free space falls under it mid-way. Finished files are "
                                          "kept: rerun the same command to resume. With the hub out of reach "
                                          "(HF_HUB_OFFLINE=1, no network), a download that finished into the "
                                          "same place is the plan, unchecked against the hub.")
    p.add_argument("repo_id", metavar="REPO_ID", help="e.g. Qwen/Qwen3-8B")
    p.add_argument("--revision", metavar="R", help="branch, tag or commit (default: the default branch)")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="only files matching GLOB (repeatable), e.g. '*.safetensors'")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip files matching GLOB (repeatable)")
    p.add_argument("--local-dir", metavar="DIR", help="download into DIR instead of the HF cache")
    p.add_argument("--reserve-gb", type=_reserve_gb, metavar="G",
                   help="keep at least G GB free (default: 5%% of the disk, at least 10 GB)")
    p.add_argument("--max-workers", type=_workers, default=8, metavar="N", help="files fetched at once, 1..64 (default 8)")
    p.add_argument("--dry-run", action="store_true", help="show what would be fetched and the disk check, then stop")
    p.add_argument("--detach", action="store_true", help="run as a detached job and return at once")
    p.add_argument("--json", action="store_true", help="print the plan (and the job id) as JSON")
    p.set_defaults(command_module=__name__)


def _workers(text: str) -> int:
    value = number(text, "a number of files (an integer)")
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"must be 1..64, got {value}")
    return value


def build_spec(args: argparse.Namespace) -> DownloadSpec:
    return DownloadSpec(
        repo_id=args.repo_id, revision=args.revision, include=tuple(args.include), exclude=tuple(args.exclude),
        local_dir=args.local_dir, reserve_bytes=None if args.reserve_gb is None else int(args.reserve_gb * 1e9),
        max_workers=args.max_workers,
    )


def describe(p: DownloadPlan) -> str:
    d = p.disk
    lines = [f"{p.spec.repo_id} @ {p.spec.revision or 'main'} ({p.commit[:12]}) -> {p.target}",
             f"  {len(p.files)} of {p.repo_files} files, {fmt_bytes(p.bytes_total)}; "
             f"to fetch: {p.files_needed} files, {fmt_bytes(p.bytes_needed)}",
             f"  disk {d.path}: {fmt_bytes(d.free)} free of {fmt_bytes(d.total)}, reserve {fmt_bytes(d.reserve)} -> "
             + ("fits" if d.ok else f"does NOT fit (short by {fmt_bytes(d.shortfall)})")]
    if p.gated:
        lines.append("  gated repo: needs a token with access")
    if p.offline:
        lines.append("  hub unreachable: this is the copy on disk, not checked against the hub")
    return "\n".join(lines) + "\n"


def _files_table(p: DownloadPlan) -> str:
    return "".join(f"  {'done ' if f.done else 'fetch'} {fmt_bytes(f.size):>10}  {f.path}\n" for f in p.files)


def run(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    the_plan = plan(spec)
    db_path = resolve_db_path(getattr(args, "db", None))
    job_spec = validate(spec.to_dict())  # paths made absolute, as the job rows hold them
    _say_who_shares(db_path, job_spec)
    if args.dry_run:
        if args.json:
            print(json.dumps(the_plan.to_dict(), indent=1))
        else:
            sys.stdout.write(describe(the_plan) + _files_table(the_plan))
        require_space(the_plan.disk)
        return 0
    if not args.json:
        sys.stdout.write(describe(the_plan))
        sys.stdout.flush()
    require_space(the_plan.disk)
    if args.detach:
        job_id = submit(db_path, "download", job_spec, name=spec.repo_id, detach=True)
        if args.json:
            print(json.dumps({"job_id": job_id, "plan": the_plan.to_dict()}))
        else:
            print(f"job {job_id} started; watch it with `ddtree-console jobs logs {job_id} --follow`")
        return 0
    return _foreground(db_path, job_spec, spec.repo_id, json_out=args.json, the_plan=the_plan)


def _say_who_shares(db_path, job_spec: dict) -> None:
    """A note on stderr when running downloads fetch the same repo into the same place."""
    if not Path(db_path).exists():
        return  # no store yet, so no download running
    with open_db(db_path) as db:
        note = sharing_note(open_downloads_of(db, job_spec["repo_id"], job_spec["local_dir"],
                                              cache_dir=job_spec["cache_dir"]))
    if note:
        print(f"note: {note}", file=sys.stderr)


def _foreground(db_path, job_spec: dict, name: str, *, json_out: bool, the_plan: DownloadPlan) -> int:
    stop = threading.Event()
    printer = threading.Thread(target=_print_progress, args=(db_path, stop), daemon=True)
    printer.start()
    try:
        # the runner runs in this process (Ctrl-C cancels the job); the printer reads its row
        job_id = submit(db_path, "download", job_spec, name=name, detach=False)
    finally:
        stop.set()
        printer.join(2)
    db = open_db(db_path)
    try:
        job = get_job(db, job_id)
    finally:
        db.close()
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if json_out:
        print(json.dumps({"job_id": job_id, "state": job.state, "result": job.result, "error": job.error,
                          "plan": the_plan.to_dict()}))
    if job.state == "succeeded":
        if not json_out:
            print(f"done: {job.result['path']}")
        return 0
    if job.state == "cancelled":
        print("cancelled: finished files are kept; rerun the same command to resume", file=sys.stderr)
        return 130
    raise DownloadJobFailed(job.error or f"download job {job_id} {job.state}")


def _print_progress(db_path, stop: threading.Event) -> None:
    """Poll the download row of the job this process runs and draw a bar on stderr."""
    tty = sys.stderr.isatty()
    started = time.time() - 1
    last_line = 0.0
    db = open_db(db_path)
    try:
        while True:
            ended = stop.wait(0.5 if tty else 1.0)
            row = download_of_runner(db, os.getpid(), started)
            if row is not None and row.get("bytes_total"):
                text = _bar(row)
                if tty:
                    sys.stderr.write(tty_frame(text, shutil.get_terminal_size().columns))
                    sys.stderr.flush()
                elif ended or time.monotonic() - last_line >= 10:
                    # the last line is the final state, so a log never ends on a stale percentage
                    last_line = time.monotonic()
                    print(text, file=sys.stderr, flush=True)
            if ended:
                break
    finally:
        db.close()


def tty_frame(text: str, columns: int) -> str:
    """One redraw of the bar in place: cut to the terminal's width, since a line that wraps puts
    the carriage return on its last row and every redraw then scrolls a new line."""
    width = max(20, columns - 1)
    return "\r" + text[:width].ljust(width)


def _bar(row: dict) -> str:
    total = row.get("bytes_total") or 0
    done = row.get("bytes_done") or 0
    filled = int((done / total if total else 1.0) * BAR_WIDTH)
    line = progress_line(done, total, row.get("files_done") or 0, row.get("files_total") or 0,
                         rate_bps=row.get("rate_bps"), eta_s=row.get("eta_s"), disk_free=row.get("disk_free_bytes"),
                         stalled=row.get("state") == "stalled")
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {line}"
