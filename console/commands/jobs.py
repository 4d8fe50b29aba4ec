"""`ddtree-console jobs`: list, inspect, start, cancel and follow jobs.

    jobs [--json] [--limit N | --all]
    jobs show ID [--json]
    jobs cancel ID [--grace S]
    jobs logs ID [--follow] [--process NAME]
    jobs submit KIND [--spec JSON] [--name NAME] [--detach] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from ddtree.console import fmt
from ddtree.console.commands import MAX_ID, nonempty_path, number
from ddtree.console.commands import job_id as _job_id
from ddtree.jobs import supervisor
from ddtree.jobs.errors import BadSpec, JobError
from ddtree.jobs.kinds import available_kinds
from ddtree.store.db import existing_store, open_db, open_existing, writable
from ddtree.store.queries import get_job, job_events, job_processes, list_jobs
from ddtree.store.records import Job

#: How often `logs --follow` looks for new output and for the end of the job.
FOLLOW_POLL_S = 0.2


class LogUnavailable(JobError):
    """The job (or the named process) has no log file."""

    exit_code = 2


def _seconds(text: str) -> float:
    value = number(text, "seconds", float)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"grace must be 0..3600 seconds, got {value:g}")
    return value


def limit(text: str) -> int:
    """argparse type of --limit: a count of rows, 1..2**63-1 (SQLite binds it as a 64-bit integer)."""
    value = number(text, "a number of rows")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    if value > MAX_ID:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_ID}, got {text}")
    return value


def list_parser(subparsers: argparse._SubParsersAction, name: str, *, help: str, description: str,
                limit_default: int | None, limit_help: str, all_help: str | None = None) -> argparse.ArgumentParser:
    """The parser of a command that lists rows (`jobs`, `runs`): --json and --limit N, alike in both;
    with `all_help`, an --all that --limit cannot be given with (one of them would be ignored)."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    how_many = p.add_mutually_exclusive_group()
    how_many.add_argument("--limit", type=limit, default=limit_default, metavar="N", help=limit_help)
    if all_help:
        how_many.add_argument("--all", action="store_true", help=all_help)
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = list_parser(subparsers, "jobs", help="list, show, start, cancel and follow jobs (downloads, engines, sweeps)",
                    description="Jobs are rows in the store plus a detached runner process each; they outlive "
                    "this terminal. Without a subcommand, list them (newest first; dead runners are marked lost "
                    "first).", limit_default=50, limit_help="how many jobs to list (default 50)",
                    all_help="list every job (default: the newest 50)")
    sub = p.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND", title="subcommands")

    show = sub.add_parser("show", help="one job: spec, result, state history, child processes",
                          description="Show one job with its spec, result, state history and child processes.")
    show.add_argument("id", type=_job_id, help="the job id")
    show.add_argument("--json", action="store_true", help="print JSON")

    cancel = sub.add_parser("cancel", help="cancel a queued or running job",
                            description="SIGTERM the job's runner (it stops its children by process group), "
                            "wait for the grace period, then SIGKILL whatever is left.")
    cancel.add_argument("id", type=_job_id, help="the job id")
    cancel.add_argument("--grace", type=_seconds, default=10.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL (default 10)")

    logs = sub.add_parser("logs", help="print a job's log (--follow: until the job ends)",
                          description="Print the runner's log of a job, or with --process the log of one of "
                          "its child processes. --follow keeps printing new lines until the job ends.")
    logs.add_argument("id", type=_job_id, help="the job id")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--process", metavar="NAME", help="a child process's log (see `jobs show ID`)")

    submit = sub.add_parser("submit", help="start a job of any kind from a JSON spec",
                            description="Validate a spec and start a job of that kind. In the foreground by "
                            "default (Ctrl-C cancels); --detach returns at once and the job keeps running.")
    submit.add_argument("kind", help=f"the job kind ({', '.join(available_kinds())})")
    submit.add_argument("--spec", default="{}", metavar="JSON", help='the spec, e.g. \'{"seconds": 5}\'')
    submit.add_argument("--name", help="a name to show in lists")
    submit.add_argument("--detach", action="store_true", help="return at once; the job outlives this terminal")
    submit.add_argument("--json", action="store_true", help="print the job as JSON when it returns")
    for nested in (show, cancel, logs, submit):
        nested.add_argument("--db", metavar="PATH", type=nonempty_path, default=argparse.SUPPRESS, help="the SQLite store")
    # argparse's usage shows the subcommand as required, but plain `jobs` lists. Set only now:
    # add_subparsers builds the subcommands' prog from the usage.
    p.usage = ("%(prog)s [-h] [--json] [--limit N | --all] [--db PATH]\n"
               f"       %(prog)s {{{','.join(sub.choices)}}} ...")


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "jobs_command", None)
    if command == "show":
        return _show(args)
    if command == "cancel":
        return _cancel(args)
    if command == "logs":
        return _logs(args)
    if command == "submit":
        return _submit(args)
    return _list(args)


def job_dict(job: Job) -> dict:
    return dataclasses.asdict(job)


def _list(args: argparse.Namespace) -> int:
    with open_existing(args.db) as db:
        # Marking dead runners lost writes; on storage this cannot write, no runner can be writing either.
        if writable(args.db):
            supervisor.reconcile(args.db)
        jobs = list_jobs(db, limit=None if args.all else args.limit)
    if args.json:
        print(json.dumps([job_dict(j) for j in jobs], indent=2))
        return 0
    if not jobs:
        print("no jobs yet (start one with `ddtree-console sweep`, `download` or `jobs submit`)")
        return 0
    now = time.time()
    rows = []
    for j in jobs:
        end = j.ended_at if j.ended_at is not None else now
        took = None if j.started_at is None else end - j.started_at
        info = j.error if j.state in ("failed", "lost", "cancelled") else j.progress_message
        rows.append([str(j.id), j.kind, j.name or "-", j.state, fmt.progress(j.progress_done, j.progress_total),
                     fmt.ago(j.created_at, now), fmt.duration(took), fmt.one_line(info)])
    print(fmt.table(["ID", "KIND", "NAME", "STATE", "PROGRESS", "CREATED", "TOOK", "INFO"], rows))
    return 0


def _show(args: argparse.Namespace) -> int:
    with open_existing(args.db) as db:
        job = get_job(db, args.id)
        events = job_events(db, args.id)
        procs = job_processes(db, args.id)
    if args.json:
        doc = job_dict(job)
        doc["events"] = [dataclasses.asdict(e) for e in events]
        doc["processes"] = [dataclasses.asdict(p) for p in procs]
        print(json.dumps(doc, indent=2))
        return 0
    safe = fmt.printable  # names, errors and messages are stored text: never print them raw
    print(f"job {job.id}  {job.kind}  {safe(job.name or '')}".rstrip())
    print(f"state     {job.state}" + (f"  ({safe(job.error)})" if job.error else ""))
    print(f"progress  {fmt.progress(job.progress_done, job.progress_total)}  {safe(job.progress_message or '')}".rstrip())
    print(f"runner    pid {job.pid or '-'} on {job.host or '-'}; heartbeat {fmt.ago(job.heartbeat_at)}")
    print(f"log       {safe(job.log_path or '-')}")
    print(f"spec      {json.dumps(job.spec, sort_keys=True)}")
    if job.result is not None:
        print(f"result    {json.dumps(job.result, sort_keys=True)}")
    print("history")
    for e in events:
        print(f"  {fmt.stamp(e.at, seconds=True)}  {e.state:<10} {safe(e.message or '')}".rstrip())
    if procs:
        print("processes")
        for p in procs:
            # a child closed without its exit status (its runner died, and a later look found it
            # gone) ended in a way no one saw: "gone", not "exit None"
            status = ("running" if p.ended_at is None else "gone" if p.returncode is None
                      else f"exit {p.returncode}")
            print(f"  {safe(p.name):<12} pid {p.pid:<8} {status:<10} {safe(p.log_path or '')}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    job = supervisor.cancel(existing_store(args.db), args.id, grace_s=args.grace)
    print(f"job {job.id} {job.state}" + (f" ({fmt.printable(job.error)})" if job.error and job.state != "cancelled" else ""))
    return 0 if job.state == "cancelled" else 1


def _log_path(db, job: Job, process: str | None) -> Path:
    if process is None:
        if not job.log_path:
            raise LogUnavailable(f"job {job.id} has no log file")
        return Path(job.log_path)
    matches = [p for p in job_processes(db, job.id) if p.name == process]
    if not matches or not matches[-1].log_path:
        names = sorted({p.name for p in job_processes(db, job.id)})
        raise LogUnavailable(f"job {job.id} has no process named {process!r}",
                             f"its processes: {', '.join(names)}" if names else "it has started none")
    return Path(matches[-1].log_path)


def _logs(args: argparse.Namespace) -> int:
    with open_existing(args.db) as db:
        job = get_job(db, args.id)
        path = _log_path(db, job, args.process)
        if not args.follow:
            if not path.exists():
                raise _no_log(job, path)
            _copy(path, 0)
            return 0
        offset = 0
        while True:
            job = get_job(db, args.id)
            # Read after checking the state, so lines written just before the end are not lost.
            if path.exists():
                offset = _copy(path, offset)
            elif job.terminal:
                raise _no_log(job, path)
            if job.terminal:
                return 0
            time.sleep(FOLLOW_POLL_S)


def _no_log(job: Job, path: Path) -> LogUnavailable:
    # Only a job that has not ended can still write one; an ended job's log was never written or removed.
    if job.terminal:
        return LogUnavailable(f"job {job.id} has no log", f"{job.state}; no file at {path}")
    return LogUnavailable(f"job {job.id} has no log yet", f"expected at {path}")


def _copy(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    if data:
        out = sys.stdout.buffer
        out.write(data)
        out.flush()
    return offset + len(data)


def _submit(args: argparse.Namespace) -> int:
    try:
        spec = json.loads(args.spec)
    except ValueError as exc:
        raise BadSpec(f"--spec is not valid JSON: {exc}", 'e.g. --spec \'{"seconds": 5}\'') from None
    run_id = spec.get("run_id") if args.kind == "sweep" and isinstance(spec, dict) else None
    if isinstance(run_id, int) and not isinstance(run_id, bool) and 1 <= run_id <= MAX_ID:
        # A run that is not there is bad input: say so now, not as a job that fails at once.
        from ddtree.store.sweeps import get_run

        with open_db(args.db) as db:
            get_run(db, run_id)
    job_id = supervisor.submit(args.db, args.kind, spec, name=args.name, detach=args.detach)
    with open_db(args.db) as db:
        job = get_job(db, job_id)
    if args.json:
        print(json.dumps(job_dict(job), indent=2))
    elif args.detach:
        print(f"job {job_id} started; follow it with `ddtree-console jobs logs {job_id} --follow`")
    elif job.state == "succeeded":
        print(f"job {job_id} succeeded")
    else:
        print(f"error: job {job_id} {job.state}" + (f": {fmt.one_line(job.error, 400)}" if job.error else ""),
              file=sys.stderr)
    if args.detach:
        return 0
    return 0 if job.state == "succeeded" else 1
