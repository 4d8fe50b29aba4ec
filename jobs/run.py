"""The job runner process: `python -m ddtree.jobs.run JOB_ID --db DB_PATH [--detach]`.

With --detach it forks once more and starts a new session, so the runner is reparented away
from whoever launched it (no zombie in the console, no SIGHUP when the SSH session ends). The
fork happens before the heavy imports, so the launcher exits within a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.jobs.run", description="Run one queued job.")
    parser.add_argument("job_id", type=int)
    parser.add_argument("--db", required=True, help="the store the job row lives in")
    parser.add_argument("--detach", action="store_true", help="fork into a new session first")
    args = parser.parse_args(argv)
    if args.detach:
        if os.fork() > 0:
            os._exit(0)
        os.setsid()
    import sqlite3

    from ddtree.jobs.errors import JobError
    from ddtree.jobs.runner import mark_failed, run_job
    from ddtree.store.errors import StoreError

    try:
        return run_job(args.db, args.job_id, detached=args.detach)
    except BaseException as exc:  # boundary: record what killed the runner, on the row and in the log
        traceback.print_exc()
        sys.stderr.flush()
        try:
            mark_failed(args.db, args.job_id, f"runner crashed: {type(exc).__name__}: {exc}")
        except (sqlite3.Error, StoreError, JobError):
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
