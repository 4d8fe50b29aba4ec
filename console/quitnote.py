"""What the console says when it closes while jobs run: they go on, and how to get back to them.

Jobs are detached processes (jobs.submit), so closing the console stops none of them; a user who
quits with a sweep half done should read that, not guess. No Textual here: the app prints the note
after its screen is gone (`run_app`), and tests call it on plain job records.
"""

from __future__ import annotations

from typing import Any

from ddtree.console import fmt
from ddtree.console.words import plural


def quit_note(jobs: list[Any], db_path: str | None = None) -> str | None:
    """None when nothing runs; else lines naming the jobs still going and the commands that show
    them again (the console itself, `ddtree-console jobs`, a job's log)."""
    active = [j for j in jobs if not j.terminal]
    if not active:
        return None
    store = f" --db {db_path}" if db_path else ""
    lines = [f"{plural(len(active), 'job')} still running; closing the console stops none of them:"]
    for job in active[:8]:
        what = fmt.one_line(job.name or job.kind, 40)
        lines.append(f"  job {job.id}  {job.kind:<8} {what}  ({job.state})")
    if len(active) > 8:
        lines.append(f"  … and {plural(len(active) - 8, 'more job', 'more jobs')}")
    lines.append(f"Back to them: ddtree-console{store} (the console shows them again), or")
    lines.append(f"  list them:         ddtree-console jobs{store}")
    lines.append(f"  follow one's log:  ddtree-console jobs logs --follow JOB_ID{store}")
    lines.append(f"  stop one:          ddtree-console jobs cancel JOB_ID{store}")
    return "\n".join(lines)
