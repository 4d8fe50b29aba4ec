"""Model downloads from the Hugging Face Hub with a disk-headroom guard.

`plan(spec)` is the preflight: it lists the repo at the revision (huggingface_hub's repo info and
tree metadata, the same listing `snapshot_download` uses), applies the include/exclude globs with
huggingface_hub's own matcher, sees which files are already complete on disk, and measures the
target filesystem. With the hub out of reach, the plan is the finished download of the same
revision into the same place, from the listing that download noted (`write_listing`), with any file
missing from disk named. `check_disk` refuses, with the numbers, when the download would leave less than
the reserve free (default max(5% of the disk, 10 GB)).

`Download(plan, ...).run()` fetches the missing files through `hf_hub_download` (one call per file,
a pool of workers, hf_xet where the hub offers it) into the HF cache or a local folder, and reports
bytes and files done, a smoothed rate, ETA and stalls. It stops hard, between two chunks, when it is
cancelled or when free space falls under the reserve (or can no longer hold what is left above it).
Finished files survive a stop, so a rerun fetches only what is missing; huggingface_hub discards
the partial file of an interrupted one (its temp files are unique per process), and a rerun deletes
the partials a killed process left (`remove_partials`).

Tokens come from the usual huggingface_hub places and are never put in results, logs or messages.

Errors (all EngineError): DownloadInputError (bad repo id, glob, revision; exit 2) with
RepoNotFound and RevisionNotFound; GatedRepo; HubUnreachable; TargetNotWritable (exit 2);
InsufficientSpace (the preflight refusal); DiskReserveReached; DownloadCancelled; DownloadFailed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ddtree.engine.errors import EngineError
from ddtree.engine.machine.host import existing_parent
from ddtree.engine.units import duration, fmt_bytes

GB = 1_000_000_000
RESERVE_FRACTION = 0.05
RESERVE_FLOOR = 10 * GB
_REPO_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?(?:/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?)?$")
_BAD_GLOB = re.compile(r"(^/|(^|/)\.\.(/|$)|[\x00-\x1f])")

DiskUsage = Callable[[Path], tuple[int, int]]  # path -> (total bytes, free bytes)


# -- errors -------------------------------------------------------------------------------------
class DownloadError(EngineError):
    pass


class DownloadInputError(DownloadError):
    exit_code = 2


class RepoNotFound(DownloadInputError):
    pass


class RevisionNotFound(DownloadInputError):
    pass


class TargetNotWritable(DownloadInputError):
    pass


class GatedRepo(DownloadError):
    pass


class HubUnreachable(DownloadError):
    pass


class InsufficientSpace(DownloadError):
    pass


class DiskReserveReached(DownloadError):
    pass


class DownloadCancelled(DownloadError):
    pass


class DownloadFailed(DownloadError):
    pass


# -- spec ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DownloadSpec:
    repo_id: str
    revision: str | None = None  # None: the default branch
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    local_dir: str | None = None  # None: the HF cache (cache_dir, else HF_HUB_CACHE)
    cache_dir: str | None = None
    reserve_bytes: int | None = None  # None: max(5% of the disk, 10 GB)
    repo_type: str = "model"
    endpoint: str | None = None  # None: HF_ENDPOINT or huggingface.co
    max_workers: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.repo_id, str) or not _REPO_ID.match(self.repo_id) or ".." in self.repo_id \
                or "--" in self.repo_id:
            raise DownloadInputError(f"not a Hugging Face repo id: {self.repo_id!r}",
                                     "expected NAMESPACE/NAME, e.g. Qwen/Qwen3-8B")
        if self.revision is not None and (not self.revision.strip() or any(c.isspace() for c in self.revision)
                                          or ".." in self.revision):
            raise DownloadInputError(f"not a valid revision: {self.revision!r}", "a branch, tag or commit hash")
        for glob in (*self.include, *self.exclude):
            if not isinstance(glob, str) or not glob.strip() or _BAD_GLOB.search(glob):
                raise DownloadInputError(f"bad glob: {glob!r}", "a pattern relative to the repo root, e.g. '*.safetensors'")
        # "" is a slip, not "here" or "the cache": refused so that every use of these reads None alone as unset
        for name, flag in (("local_dir", "--local-dir"), ("cache_dir", "cache_dir")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise DownloadInputError(f"{flag} needs a folder name, got {value!r}",
                                         "leave it out to download into the HF cache")
        if self.repo_type not in ("model", "dataset", "space"):
            raise DownloadInputError(f"unknown repo type {self.repo_type!r}", "model, dataset or space")
        if self.reserve_bytes is not None and (not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0):
            raise DownloadInputError(f"reserve must be a non-negative number of bytes, got {self.reserve_bytes!r}")
        if not isinstance(self.max_workers, int) or not 1 <= self.max_workers <= 64:
            raise DownloadInputError(f"max_workers must be in 1..64, got {self.max_workers!r}")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["include"], out["exclude"] = list(self.include), list(self.exclude)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> DownloadSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise DownloadInputError(f"unknown download spec field(s): {', '.join(unknown)}")
        data = dict(data)
        for key in ("include", "exclude"):
            value = data.get(key) or ()
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (list, tuple)):
                raise DownloadInputError(f"{key} must be a list of globs")
            data[key] = tuple(value)
        return cls(**data)


# -- disk ---------------------------------------------------------------------------------------
def _disk_usage(path: Path) -> tuple[int, int]:
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


def default_reserve(disk_total: int) -> int:
    return max(int(disk_total * RESERVE_FRACTION), RESERVE_FLOOR)


@dataclass(frozen=True)
class DiskCheck:
    path: str  # the existing folder measured
    total: int
    free: int
    reserve: int
    needed: int

    @property
    def ok(self) -> bool:
        # Nothing to fetch cannot fill the disk, however full it already is.
        return self.needed <= 0 or self.free - self.needed >= self.reserve

    @property
    def shortfall(self) -> int:
        return 0 if self.ok else self.reserve + self.needed - self.free

    def describe(self) -> str:
        return (f"needs {fmt_bytes(self.needed)}, {fmt_bytes(self.free)} free on {self.path} "
                f"(disk {fmt_bytes(self.total)}, reserve {fmt_bytes(self.reserve)})")

    def to_dict(self) -> dict:
        return dict(asdict(self), ok=self.ok, shortfall=self.shortfall)


def check_disk(target: str | os.PathLike, needed: int, reserve: int | None = None, *,
               usage: DiskUsage = _disk_usage) -> DiskCheck:
    where = existing_parent(target)
    total, free = usage(where)
    return DiskCheck(path=str(where), total=total, free=free,
                     reserve=default_reserve(total) if reserve is None else reserve, needed=needed)


def require_space(check: DiskCheck) -> None:
    if not check.ok:
        raise InsufficientSpace(
            f"will not fit: {check.describe()}; short by {fmt_bytes(check.shortfall)}",
            "free some space, choose another --local-dir, or lower --reserve-gb")


# -- the hub ------------------------------------------------------------------------------------
def token_source() -> str:
    """Where huggingface_hub takes its token from, for messages (never the token itself)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(name):
            return f"the {name} environment variable"
    from huggingface_hub import constants

    path = Path(getattr(constants, "HF_TOKEN_PATH", "") or "")
    if path and path.is_file():
        return f"the token file {path}"
    return "no token"


def _scrub(text: str) -> str:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        token = os.environ.get(name)
        if token and len(token) >= 4:
            text = text.replace(token, "<token>")
    return re.sub(r"hf_[A-Za-z0-9]{8,}", "<token>", text)


def _transport_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            mod = __import__(module)
            errors.append(mod.TransportError)
        except (ImportError, AttributeError):
            pass
    try:
        import requests

        errors.append(requests.exceptions.ConnectionError)
        errors.append(requests.exceptions.Timeout)
    except ImportError:
        pass
    return tuple(errors)


def _hub_failures() -> tuple[type[BaseException], ...]:
    from huggingface_hub import errors as hf

    return (hf.HfHubHTTPError, hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled, hf.HFValidationError,
            OSError, *_transport_errors())


def _endpoint(spec: DownloadSpec) -> str:
    if spec.endpoint:
        return spec.endpoint.rstrip("/")
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def hub_error(error: BaseException, spec: DownloadSpec) -> DownloadError:
    """Turn a huggingface_hub / transport error into one of ours, with a hint and no token."""
    from huggingface_hub import errors as hf

    endpoint = _endpoint(spec)
    where = f"{endpoint}/{spec.repo_id}"
    if isinstance(error, hf.GatedRepoError):
        return GatedRepo(f"{spec.repo_id} is gated and this token has no access",
                         f"request access at {where}; token used: {token_source()}")
    if isinstance(error, hf.RepositoryNotFoundError):
        return RepoNotFound(f"repository {spec.repo_id} not found on {endpoint}",
                            f"check the name; a private repo needs a token (token used: {token_source()})")
    if isinstance(error, hf.RevisionNotFoundError):
        return RevisionNotFound(f"revision {spec.revision!r} not found in {spec.repo_id}",
                                f"see the branches and tags at {where}")
    if isinstance(error, hf.EntryNotFoundError) and not isinstance(error, hf.LocalEntryNotFoundError):
        return DownloadFailed(f"a file of {spec.repo_id} vanished from the hub during the download",
                              "the revision moved; rerun to fetch the new listing")
    if isinstance(error, (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled, *_transport_errors())):
        hint = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0") else \
            "check the network, or set HF_ENDPOINT to a reachable mirror"
        return HubUnreachable(f"cannot reach {endpoint}: {_scrub(type(error).__name__)}", hint)
    if isinstance(error, hf.HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        return DownloadFailed(f"the hub answered {status} for {spec.repo_id}", _scrub(str(error).splitlines()[0])[:200])
    if isinstance(error, hf.HFValidationError):
        return DownloadInputError(_scrub(str(error).splitlines()[0])[:200])
    if isinstance(error, PermissionError):
        return TargetNotWritable(f"permission denied: {error.filename}", "choose a folder you can write")
    return DownloadFailed(_scrub(f"{type(error).__name__}: {error}")[:300])


@dataclass(frozen=True)
class DownloadPlanFile:
    path: str
    size: int
    done: bool  # already complete on disk


@dataclass(frozen=True)
class DownloadPlan:
    spec: DownloadSpec
    commit: str
    files: tuple[DownloadPlanFile, ...]
    target: str  # the local folder or the repo's cache folder
    disk: DiskCheck
    gated: bool = False
    repo_files: int = 0  # files in the repo before the globs
    #: The hub could not be reached (or HF_HUB_OFFLINE is set) and the plan is a finished download's
    #: copy on disk (_plan_on_disk): not checked against the hub.
    offline: bool = False
    #: (path, size) of every file of the repo at the commit, before the globs: what a finished
    #: download records on disk (write_listing), so that an offline plan knows what is missing.
    listing: tuple[tuple[str, int], ...] = ()

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_needed(self) -> int:
        return sum(f.size for f in self.files if not f.done)

    @property
    def files_needed(self) -> int:
        return sum(not f.done for f in self.files)

    def to_dict(self) -> dict:
        return {
            "repo_id": self.spec.repo_id, "revision": self.spec.revision, "commit": self.commit,
            "target": self.target, "gated": self.gated, "repo_files": self.repo_files, "offline": self.offline,
            "files_total": len(self.files), "files_needed": self.files_needed,
            "bytes_total": self.bytes_total, "bytes_needed": self.bytes_needed,
            "disk": self.disk.to_dict(),
            "files": [asdict(f) for f in self.files],
        }


def _repo_folder(spec: DownloadSpec) -> Path:
    from huggingface_hub import constants

    cache = Path(spec.cache_dir if spec.cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    return cache / f"{spec.repo_type}s--{spec.repo_id.replace('/', '--')}"


def _etag(entry: Any) -> str:
    """The etag huggingface_hub records for a file of the tree: its LFS sha256, else its git oid."""
    lfs = getattr(entry, "lfs", None)
    return str(getattr(lfs, "sha256", None) or getattr(entry, "blob_id", "") or "")


def _is_done(spec: DownloadSpec, commit: str, path: str, size: int, etag: str) -> bool:
    if spec.local_dir is not None:
        # The size alone is not enough: a revision that fixes the weights keeps their shapes, so
        # the old file would pass. huggingface_hub notes each file's etag beside it (and ignores
        # the note once the file is touched after); a file without a matching note is fetched.
        local_dir = Path(spec.local_dir).expanduser()
        local = local_dir / path
        if not (local.is_file() and local.stat().st_size == size):
            return False
        try:
            from huggingface_hub._local_folder import read_download_metadata
        except ImportError:  # a huggingface_hub without it: let hf_hub_download decide
            return False
        meta = read_download_metadata(local_dir, path)
        return meta is not None and bool(etag) and meta.etag == etag
    return (_repo_folder(spec) / "snapshots" / commit / path).is_file()


def _check_writable(target: Path) -> None:
    where = existing_parent(target)
    if not where.is_dir():
        # A file at (or above) the target: no permission would help, so say what it is.
        raise TargetNotWritable(f"not a directory: {where}", "give --local-dir a folder, or a path that does not exist yet")
    if not os.access(where, os.W_OK | os.X_OK):
        raise TargetNotWritable(f"permission denied: cannot write under {where}",
                                "choose a folder you can write with --local-dir")


def plan(spec: DownloadSpec, *, usage: DiskUsage = _disk_usage) -> DownloadPlan:
    """The preflight: what the revision holds, what the globs keep, what is missing, the disk."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    target = Path(spec.local_dir).expanduser() if spec.local_dir is not None else _repo_folder(spec)
    _check_writable(target)
    api = HfApi(endpoint=spec.endpoint)
    try:
        info = api.repo_info(spec.repo_id, revision=spec.revision, repo_type=spec.repo_type)
        commit = info.sha
        entries = [f for f in api.list_repo_tree(spec.repo_id, revision=commit, repo_type=spec.repo_type,
                                                 recursive=True) if isinstance(f, RepoFile)]
    except _hub_failures() as error:
        failure = hub_error(error, spec)
        if isinstance(failure, HubUnreachable):
            on_disk = _plan_on_disk(spec, target, usage)
            if on_disk is not None and not on_disk.files_needed:
                return on_disk
            if on_disk is not None:
                failure = HubUnreachable(
                    f"{failure.message}, and {on_disk.files_needed} of the {len(on_disk.files)} files asked for "
                    f"are not on disk", failure.hint)
        raise failure from None
    if not commit:
        raise DownloadFailed(f"the hub gave no commit for {spec.repo_id}")
    kept = list(filter_repo_objects(entries, allow_patterns=list(spec.include) or None,
                                    ignore_patterns=list(spec.exclude) or None, key=lambda f: f.path))
    if entries and not kept:
        raise DownloadInputError(
            f"no file of {spec.repo_id} matches the globs (include {list(spec.include)}, exclude {list(spec.exclude)})",
            f"the repo has {len(entries)} files, e.g. {', '.join(sorted(f.path for f in entries)[:3])}")
    files = tuple(DownloadPlanFile(path=f.path, size=int(f.size or 0),
                                   done=_is_done(spec, commit, f.path, int(f.size or 0), _etag(f)))
                  for f in sorted(kept, key=lambda f: f.path))
    needed = sum(f.size for f in files if not f.done)
    disk = check_disk(target, needed, spec.reserve_bytes, usage=usage)
    return DownloadPlan(spec=spec, commit=commit, files=files, target=str(target), disk=disk,
                        gated=bool(getattr(info, "gated", False)), repo_files=len(entries),
                        listing=tuple(sorted((f.path, int(f.size or 0)) for f in entries)))


def _listings(spec: DownloadSpec, target: Path) -> Path:
    """Where finished downloads into `target` note the repo's listing, one JSON file per commit,
    with refs/<revision> naming the commit: beside huggingface_hub's own notes."""
    if spec.local_dir is not None:
        return target / ".cache" / "huggingface" / "ddtree-listings"
    return target / "ddtree-listings"


def write_listing(plan: DownloadPlan) -> None:
    """Note, once every file of `plan` is on disk, the repo's listing at its commit and the
    revision it came from: an offline plan of the same target reads them (_plan_on_disk)."""
    if not plan.listing or not plan.commit:
        return
    folder = _listings(plan.spec, Path(plan.target))
    if plan.spec.local_dir is not None:  # a folder holds one commit's files: the older notes are stale
        for stale in folder.glob("*.json"):
            if stale.stem != plan.commit:
                stale.unlink(missing_ok=True)
    for path, text in ((folder / f"{plan.commit}.json", json.dumps([list(e) for e in plan.listing])),
                       (folder / "refs" / (plan.spec.revision or "main"), plan.commit)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _plan_on_disk(spec: DownloadSpec, target: Path, usage: DiskUsage) -> DownloadPlan | None:
    """For when the hub cannot be reached: the plan from the listing a finished download of this
    revision into this target noted (write_listing), each file done if it is on disk at its size.
    None without such a note (a download never finished here, or the files came another way)."""
    from huggingface_hub.utils import filter_repo_objects

    revision = spec.revision or "main"
    folder = _listings(spec, target)
    commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else ""
    if not commit and ".." not in revision and not revision.startswith("/"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            commit = (folder / "refs" / revision).read_text().strip()
    try:
        listing = [(str(path), int(size)) for path, size in json.loads((folder / f"{commit}.json").read_text())] \
            if re.fullmatch(r"[0-9a-f]{40}", commit) else []
    except (OSError, ValueError, TypeError):
        listing = []
    if not listing:
        return None
    files_at = target if spec.local_dir is not None else target / "snapshots" / commit
    kept = filter_repo_objects(listing, allow_patterns=list(spec.include) or None,
                               ignore_patterns=list(spec.exclude) or None, key=lambda e: e[0])

    def on_disk(path: str, size: int) -> bool:
        try:
            return (files_at / path).stat().st_size == size
        except OSError:
            return False

    files = tuple(DownloadPlanFile(path=path, size=size, done=on_disk(path, size)) for path, size in kept)
    if not files:
        return None
    return DownloadPlan(spec=spec, commit=commit, files=files, target=str(target),
                        disk=check_disk(target, 0, spec.reserve_bytes, usage=usage), repo_files=len(listing),
                        offline=True, listing=tuple(listing))


def _partials_and_locks(spec: DownloadSpec) -> tuple[list[Path], list[Path]]:
    """The temp files huggingface_hub writes while fetching into this spec's target, and the
    lock files it holds meanwhile (the HF cache layout, or a local dir's .cache/huggingface)."""
    if spec.local_dir is not None:
        root = Path(spec.local_dir).expanduser() / ".cache" / "huggingface" / "download"
        return sorted(root.rglob("*.incomplete")), sorted(root.rglob("*.lock"))
    folder = _repo_folder(spec)
    return (sorted((folder / "blobs").glob("*.incomplete")),
            sorted((folder.parent / ".locks" / folder.name).glob("*.lock")))


def remove_partials(spec: DownloadSpec) -> int:
    """Delete the partial files a killed download of this repo left behind; returns their bytes.

    huggingface_hub names each partial after its process (`<etag>.<uuid>.incomplete`) and deletes
    it when that process unwinds, so after a kill -9 nothing ever reuses or removes it. A partial
    is only an orphan when no process is fetching into the target: this holds every lock
    huggingface_hub takes there while deleting, and removes nothing when one is held."""
    from filelock import FileLock, Timeout  # huggingface_hub's own dependency, and its locks

    partials, locks = _partials_and_locks(spec)
    if not partials:
        return 0
    freed = 0
    with contextlib.ExitStack() as held:
        try:
            for lock in locks:
                held.enter_context(FileLock(str(lock), timeout=0, mode=0o664))
        except (Timeout, OSError):
            return 0
        for part in partials:
            try:
                size = part.stat().st_size
                part.unlink()
            except FileNotFoundError:
                continue
            freed += size
    return freed


# -- progress -----------------------------------------------------------------------------------
@dataclass
class Progress:
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int = 0
    rate_bps: float | None = None  # smoothed
    eta_s: float | None = None
    stalled_s: float = 0.0  # seconds without a byte, once past the stall threshold
    disk_free: int | None = None
    reserve: int = 0
    elapsed_s: float = 0.0

    @property
    def stalled(self) -> bool:
        return self.stalled_s > 0

    def line(self) -> str:
        return progress_line(self.bytes_done, self.bytes_total, self.files_done, self.files_total,
                             rate_bps=self.rate_bps, eta_s=self.eta_s, disk_free=self.disk_free,
                             stalled=self.stalled, stalled_s=self.stalled_s)


def progress_line(bytes_done: int, bytes_total: int, files_done: int, files_total: int, *,
                  rate_bps: float | None, eta_s: float | None, disk_free: int | None,
                  stalled: bool = False, stalled_s: float | None = None) -> str:
    """The one progress line of a download, for its job log and the CLI's bar (which reads the
    same numbers back from the `downloads` row, where the stall's length is not kept)."""
    pct = 100.0 * bytes_done / bytes_total if bytes_total else 100.0
    rate = f"{fmt_bytes(rate_bps)}/s" if rate_bps else "-"
    text = (f"{pct:5.1f}% {fmt_bytes(bytes_done)}/{fmt_bytes(bytes_total)} "
            f"files {files_done}/{files_total} {rate} eta {duration(eta_s)} free {fmt_bytes(disk_free)}")
    if stalled:
        text += " STALLED" + (f" {stalled_s:.0f}s" if stalled_s else "")
    return text


class _Stop(Exception):
    """Raised inside huggingface_hub's download loop (from the progress callback) to abort a file."""


class _FileBar:
    """Stands in for tqdm in `hf_hub_download`: counts bytes of one file and aborts on request."""

    def __init__(self, owner: Download, path: str, **kwargs: Any) -> None:
        self._owner, self._path = owner, path
        self.n = int(kwargs.get("initial") or 0)
        self.total = kwargs.get("total")
        owner._bar_started(path, self)

    def update(self, n: float | None = 1) -> None:
        if self._owner._abort is not None:
            raise _Stop()
        self.n += int(n or 0)
        self._owner._last_byte_at = time.monotonic()

    def update_transfer(self, n: float | None = 1) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class Download:
    """Fetch the missing files of a plan, reporting progress every `interval_s`."""

    def __init__(self, plan: DownloadPlan, *, stop: threading.Event | None = None,
                 on_progress: Callable[[Progress], None] | None = None, interval_s: float = 0.5,
                 stall_s: float = 30.0, rate_window_s: float = 5.0, usage: DiskUsage = _disk_usage,
                 on_abort: Callable[[DownloadError, Progress], None] | None = None) -> None:
        self.plan = plan
        self.stop = stop or threading.Event()
        self.on_progress = on_progress
        #: Called once, the moment the download is stopped (cancel, disk, a failed file), before
        #: the files in flight notice: huggingface_hub checks in once per 10 MB chunk, which on a
        #: slow link outlasts a runner's grace, so a caller records the outcome here.
        self.on_abort = on_abort
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.rate_window_s = rate_window_s
        self.usage = usage
        self._lock = threading.Lock()
        self._bars: dict[str, _FileBar] = {}
        self._finished: set[str] = {f.path for f in plan.files if f.done}
        self._abort: DownloadError | None = None
        self._last_byte_at = time.monotonic()
        self.progress = Progress(bytes_total=plan.bytes_total, files_total=len(plan.files),
                                 reserve=plan.disk.reserve)

    def _bar_started(self, path: str, bar: _FileBar) -> None:
        with self._lock:
            self._bars[path] = bar

    def _fetch(self, path: str) -> None:
        from huggingface_hub import hf_hub_download

        spec = self.plan.spec
        if self._abort is not None:
            raise _Stop()
        hf_hub_download(
            spec.repo_id, filename=path, revision=self.plan.commit, repo_type=spec.repo_type,
            cache_dir=spec.cache_dir, local_dir=spec.local_dir, endpoint=spec.endpoint,
            tqdm_class=lambda **kw: _FileBar(self, path, **kw),
        )

    def _bytes_done(self) -> int:
        sizes = {f.path: f.size for f in self.plan.files}
        with self._lock:
            done = sum(sizes[p] for p in self._finished)
            done += sum(max(0, bar.n) for p, bar in self._bars.items() if p not in self._finished)
        return done

    def _measure(self, t0: float, history: list[tuple[float, int]]) -> Progress:
        now = time.monotonic()
        p = self.progress
        p.bytes_done = self._bytes_done()
        p.files_done = len(self._finished)
        p.elapsed_s = now - t0
        history.append((now, p.bytes_done))
        while len(history) > 2 and history[1][0] < now - self.rate_window_s:
            history.pop(0)
        span = history[-1][0] - history[0][0]
        if span > 0:
            window_rate = (history[-1][1] - history[0][1]) / span
            # an EMA over the window rate: steady numbers without hiding a real slowdown for long
            p.rate_bps = window_rate if p.rate_bps is None else 0.7 * p.rate_bps + 0.3 * window_rate
        remaining = max(0, p.bytes_total - p.bytes_done)
        p.eta_s = remaining / p.rate_bps if p.rate_bps and p.rate_bps > 0 else (0.0 if not remaining else None)
        idle = now - self._last_byte_at
        p.stalled_s = idle if idle >= self.stall_s and remaining else 0.0
        _, p.disk_free = self.usage(existing_parent(self.plan.target))
        return replace(p)  # a copy: callers keep samples

    def _check_limits(self, p: Progress) -> None:
        if self._abort is not None:
            return
        if self.stop.is_set():
            self._abort = DownloadCancelled("download cancelled", "rerun the same command to resume: finished files are kept")
            return
        remaining = max(0, p.bytes_total - p.bytes_done)
        free = p.disk_free if p.disk_free is not None else 0
        # allow for filesystem overhead on what is left before calling it a shortfall
        slack = max(64 * 1024**2, p.bytes_total // 100)
        if free < p.reserve or free - remaining < p.reserve - slack:
            self._abort = DiskReserveReached(
                f"stopped: {fmt_bytes(free)} free under {self.plan.disk.path}, reserve {fmt_bytes(p.reserve)}, "
                f"{fmt_bytes(remaining)} still to fetch",
                "something else is filling the disk; free space and rerun to resume")

    def run(self) -> dict:
        """Download; returns a result dict. Raises DownloadCancelled, DiskReserveReached, or a hub error."""
        require_space(self.plan.disk)
        freed = remove_partials(self.plan.spec)
        t0 = time.monotonic()
        history: list[tuple[float, int]] = []
        todo = [f.path for f in self.plan.files if not f.done]
        errors: list[BaseException] = []
        self._last_byte_at = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=min(self.plan.spec.max_workers, max(1, len(todo))),
                                  thread_name_prefix="ddtree-download")
        try:
            futures: dict[Future, str] = {pool.submit(self._fetch, path): path for path in todo}
            pending = set(futures)
            next_report = 0.0
            aborted = False
            while pending:
                done, pending = wait(pending, timeout=self.interval_s, return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut.cancelled():
                        continue
                    error = fut.exception()
                    if error is None:
                        with self._lock:
                            self._finished.add(futures[fut])
                    elif not isinstance(error, _Stop):
                        errors.append(error)
                        if self._abort is None:
                            self._abort = hub_error(error, self.plan.spec)
                p = self._measure(t0, history)
                self._check_limits(p)
                if self._abort is not None:
                    if not aborted and self.on_abort is not None:
                        self.on_abort(self._abort, p)
                    aborted = True
                    for fut in pending:
                        fut.cancel()
                if self.on_progress is not None and (time.monotonic() >= next_report or not pending):
                    next_report = time.monotonic() + self.interval_s
                    self.on_progress(p)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        p = self._measure(t0, history)
        if self.on_progress is not None:
            self.on_progress(p)
        if self._abort is not None:
            raise self._abort
        self._finalize()
        write_listing(self.plan)
        return {
            "repo_id": self.plan.spec.repo_id, "commit": self.plan.commit, "path": self._snapshot_path(),
            "bytes_total": p.bytes_total, "files_total": p.files_total,
            "bytes_fetched": self.plan.bytes_needed, "files_fetched": self.plan.files_needed,
            "elapsed_s": round(p.elapsed_s, 3), "partials_removed_bytes": freed,
            "mean_rate_bps": round(self.plan.bytes_needed / p.elapsed_s, 1) if p.elapsed_s > 0 else None,
        }

    def _snapshot_path(self) -> str:
        if self.plan.spec.local_dir is not None:
            return str(Path(self.plan.spec.local_dir).expanduser().resolve())
        return str(_repo_folder(self.plan.spec) / "snapshots" / self.plan.commit)

    def _finalize(self) -> None:
        """Record the branch -> commit ref in the cache, as snapshot_download does, so that loading
        by repo id and branch name works offline afterwards."""
        spec = self.plan.spec
        revision = spec.revision or "main"
        if spec.local_dir is not None or re.fullmatch(r"[0-9a-f]{40}", revision):
            return
        ref = _repo_folder(spec) / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(self.plan.commit)
        tmp.replace(ref)
