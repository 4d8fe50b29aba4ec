"""`download`: fetch a Hugging Face repo (or part of it) with a disk-headroom guard.

spec: {"repo_id": str, "revision": str | None, "include": [glob], "exclude": [glob],
       "local_dir": str | None, "cache_dir": str | None, "reserve_bytes": int | None,
       "endpoint": str | None, "max_workers": int}
Paths are made absolute when the job is submitted; with no local_dir the HF cache in force at
submit time is recorded, so the detached runner writes where the submitter meant. The token is
never part of the spec: huggingface_hub reads it from HF_TOKEN or the token file at run time.

Progress goes to the `downloads` row of the job (bytes/files done and total, smoothed rate, ETA,
free space, reserve, state: running | stalled | succeeded | failed | cancelled) and to
ctx.progress (bytes).
"""

from __future__ import annotations

from pathlib import Path

from ddtree.engine.machine.download import Download, DownloadCancelled, DownloadError, DownloadSpec, Progress, plan
from ddtree.engine.machine.host import hf_cache_dir
from ddtree.jobs.context import JobContext
from ddtree.jobs.errors import BadSpec, JobCancelled, JobError
from ddtree.store.downloads import create_download, open_downloads_of, update_download
from ddtree.store.queries import now

#: Seconds between two writes of the downloads row (the last value always lands).
ROW_INTERVAL_S = 0.5


class DownloadJobError(JobError):
    """A download failure, carried to the job row as one line with its hint."""


def validate(spec: dict) -> dict:
    if not isinstance(spec, dict):
        raise BadSpec("a download spec is a JSON object")
    try:
        parsed = DownloadSpec.from_dict(spec)
    except DownloadError as exc:
        raise BadSpec(exc.message, exc.hint) from None
    except TypeError:
        raise BadSpec("a download spec needs repo_id", "e.g. {\"repo_id\": \"Qwen/Qwen3-8B\"}") from None
    out = parsed.to_dict()
    if out["local_dir"]:
        out["local_dir"] = str(Path(out["local_dir"]).expanduser().absolute())
    else:
        out["cache_dir"] = str(Path(out["cache_dir"] or hf_cache_dir()).expanduser().absolute())
    return out


class _Recorder:
    """Writes the downloads row and the job progress from the job's own thread."""

    def __init__(self, ctx: JobContext, row_id: int) -> None:
        self.ctx, self.row_id = ctx, row_id
        self.written_at = 0.0
        self.last: Progress | None = None
        self.ended = False  # the row holds its final state: progress no longer writes `running`

    def write(self, values: dict) -> None:
        update_download(self.ctx.db, self.row_id, values)

    def __call__(self, p: Progress, *, force: bool = False) -> None:
        self.last = p
        t = now()
        if self.ended or (not force and t - self.written_at < ROW_INTERVAL_S):
            return
        self.written_at = t
        self.write({
            "state": "stalled" if p.stalled else "running",
            "bytes_done": p.bytes_done, "bytes_total": p.bytes_total,
            "files_done": p.files_done, "files_total": p.files_total,
            "rate_bps": p.rate_bps, "eta_s": p.eta_s, "disk_free_bytes": p.disk_free,
        })
        self.ctx.progress(p.bytes_done, p.bytes_total, p.line())


def run(ctx: JobContext, spec: dict) -> dict:
    dspec = DownloadSpec.from_dict(spec)
    row_id = create_download(ctx.db, ctx.job_id, repo_id=dspec.repo_id, revision=dspec.revision,
                             include=list(dspec.include), local_dir=dspec.local_dir)
    recorder = _Recorder(ctx, row_id)
    note = sharing_note(open_downloads_of(ctx.db, dspec.repo_id, dspec.local_dir, cache_dir=dspec.cache_dir,
                                          besides=ctx.job_id))
    if note:
        ctx.log(note)
    try:
        ctx.log(f"listing {dspec.repo_id} at {dspec.revision or 'the default branch'}")
        the_plan = plan(dspec)
        disk = the_plan.disk
        if the_plan.offline:
            ctx.log("the hub is out of reach: using the finished download on disk, not checked against the hub")
        ctx.log(f"{len(the_plan.files)} files, {the_plan.bytes_total} bytes; to fetch: {the_plan.files_needed} files, "
                f"{the_plan.bytes_needed} bytes; {disk.describe()}")
        recorder.write({
            "revision": dspec.revision or "main", "state": "running",
            "bytes_total": the_plan.bytes_total, "files_total": len(the_plan.files),
            "bytes_done": the_plan.bytes_total - the_plan.bytes_needed,
            "files_done": len(the_plan.files) - the_plan.files_needed,
            "disk_free_bytes": disk.free, "reserve_bytes": disk.reserve,
        })
        ctx.check_cancelled()
        result = Download(the_plan, stop=ctx.cancelled, on_progress=recorder,
                          on_abort=lambda error, p: _stopped(recorder, error, p)).run()
    except DownloadCancelled:
        _end(recorder, "cancelled", None)
        raise JobCancelled(f"download of {dspec.repo_id} cancelled") from None
    except JobCancelled:
        _end(recorder, "cancelled", None)
        raise
    except DownloadError as exc:
        _end(recorder, "failed", str(exc))
        ctx.log(f"error: {exc}")
        raise DownloadJobError(exc.message, exc.hint) from None
    if recorder.last is not None:
        recorder(recorder.last, force=True)
    _end(recorder, "succeeded", None)
    if result.get("partials_removed_bytes"):
        ctx.log(f"removed {result['partials_removed_bytes']} bytes of partial files an interrupted download left")
    ctx.log(f"done: {result['path']} ({result['bytes_fetched']} bytes fetched in {result['elapsed_s']} s)")
    return result


def sharing_note(others: list[dict]) -> str:
    """What a download sharing its files with running ones will see, or "" for none."""
    if not others:
        return ""
    jobs = ", ".join(str(r["job_id"]) for r in others)
    return (f"job {jobs} is fetching the same repo into the same place: a file both need is fetched "
            "once, and this download waits for it (huggingface_hub's file locks)")


def _stopped(recorder: _Recorder, error: DownloadError, p: Progress) -> None:
    """Close the row as soon as the download is stopped: the runner may give up waiting for the
    files in flight (and exit) before they notice."""
    recorder.last = p
    if isinstance(error, DownloadCancelled):
        _end(recorder, "cancelled", None)
    else:
        _end(recorder, "failed", str(error))


def _end(recorder: _Recorder, state: str, error: str | None) -> None:
    values: dict = {"state": state, "ended_at": now(), "error": error}
    p = recorder.last
    if p is not None:
        values.update(bytes_done=p.bytes_done, files_done=p.files_done, rate_bps=p.rate_bps,
                      eta_s=None if state != "succeeded" else 0.0, disk_free_bytes=p.disk_free)
    recorder.write(values)
    recorder.ended = True
