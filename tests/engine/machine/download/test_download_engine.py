"""engine.download against the local hub with the real huggingface_hub client."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ddtree.engine.machine.download import (
    DiskReserveReached,
    Download,
    DownloadCancelled,
    DownloadInputError,
    DownloadSpec,
    GatedRepo,
    HubUnreachable,
    InsufficientSpace,
    RepoNotFound,
    RevisionNotFound,
    check_disk,
    default_reserve,
    plan,
)

from .conftest import BAD_TOKEN, GOOD_TOKEN

GB = 1_000_000_000


def spec(hub, tmp_path, repo="acme/tiny", **kw) -> DownloadSpec:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("reserve_bytes", 0)
    return DownloadSpec(repo_id=repo, endpoint=hub.url, **kw)


def roomy(path):  # a big empty disk
    return 4000 * GB, 3000 * GB


def test_plan_sizes_and_globs(hub, tmp_path):
    p = plan(spec(hub, tmp_path))
    assert p.repo_files == 5 and len(p.files) == 5
    assert p.bytes_total == sum(map(len, hub.repos["acme/tiny"].files.values())) == p.bytes_needed
    assert p.commit == hub.repos["acme/tiny"].sha
    only = plan(spec(hub, tmp_path, include=("*.safetensors",)))
    assert [f.path for f in only.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert only.bytes_needed == 500_000
    folder = plan(spec(hub, tmp_path, include=("sub/*",), exclude=("*.md",)))
    assert [f.path for f in folder.files] == ["sub/extra.bin"]
    # the tree came in pages of 3 (Link header) and nothing was downloaded
    assert not [r for r in hub.requests if "/resolve/" in r.path]


def test_full_download_to_cache_then_nothing_left(hub, tmp_path):
    seen = []
    p = plan(spec(hub, tmp_path, revision="v1"), usage=roomy)
    result = Download(p, on_progress=seen.append, interval_s=0.05, usage=roomy).run()
    snap = Path(result["path"])
    repo = hub.repos["acme/tiny"]
    for name, data in repo.files.items():
        assert (snap / name).read_bytes() == data
    assert (tmp_path / "cache/models--acme--tiny/refs/v1").read_text() == repo.sha
    assert result["bytes_fetched"] == p.bytes_total and result["files_fetched"] == 5
    last = seen[-1]
    assert last.bytes_done == last.bytes_total == p.bytes_total and last.files_done == 5 and last.eta_s == 0
    assert [s.bytes_done for s in seen] == sorted(s.bytes_done for s in seen)
    again = plan(spec(hub, tmp_path, revision="v1"))
    assert again.bytes_needed == 0 and again.files_needed == 0


def test_local_dir_download(hub, tmp_path):
    target = tmp_path / "models" / "tiny"
    p = plan(spec(hub, tmp_path, local_dir=str(target), include=("*.json", "sub/*")))
    result = Download(p).run()
    assert Path(result["path"]) == target.resolve()
    assert (target / "config.json").read_bytes() == hub.repos["acme/tiny"].files["config.json"]
    assert (target / "sub/extra.bin").stat().st_size == 50_000
    assert not (target / "README.md").exists()
    assert plan(spec(hub, tmp_path, local_dir=str(target), include=("*.json", "sub/*"))).files_needed == 0


def test_reserve_refusal_before_any_byte(hub, tmp_path):
    small_disk = lambda path: (100 * GB, 10 * GB + 200_000)  # noqa: E731 - a 100 GB disk, 10.0002 GB free
    p = plan(spec(hub, tmp_path, reserve_bytes=None), usage=small_disk)
    assert p.disk.reserve == default_reserve(100 * GB) == 10 * GB  # max(5%, 10 GB)
    assert not p.disk.ok and p.disk.shortfall == p.bytes_needed - 200_000
    with pytest.raises(InsufficientSpace) as err:
        Download(p, usage=small_disk).run()
    text = str(err.value)
    assert "needs 550.0 kB" in text and "10.0 GB free" in text and "reserve 10.0 GB" in text and "short by" in text
    assert not [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    big = check_disk(tmp_path, 0, None, usage=lambda p: (1000 * GB, 500 * GB))
    assert big.reserve == 50 * GB and big.ok


def test_hard_stop_when_disk_fills_mid_download(hub, tmp_path):
    hub.rate_bps = 2_000_000
    blobs = tmp_path / "cache" / "models--acme--many" / "blobs"

    def filling(path):
        # Something else fills the disk once the download has finished a file: a trigger on
        # progress, not on the count of calls, which a loaded box reached before any file was in.
        done = blobs.is_dir() and any(not b.name.endswith(".incomplete") for b in blobs.iterdir())
        return 100 * GB, (1 * GB if done else 50 * GB)

    p = plan(spec(hub, tmp_path, repo="acme/many", reserve_bytes=5 * GB, max_workers=2), usage=filling)
    assert p.disk.ok
    with pytest.raises(DiskReserveReached) as err:
        Download(p, interval_s=0.05, usage=filling).run()
    assert "1.0 GB free" in str(err.value) and "reserve 5.0 GB" in str(err.value)
    left = plan(spec(hub, tmp_path, repo="acme/many"))
    assert 0 < left.files_needed < len(left.files)


def test_cancel_then_resume_without_refetching(hub, tmp_path):
    hub.rate_bps = 1_500_000  # 16 files of 96 kB at 1.5 MB/s per connection
    stop = threading.Event()

    def on_progress(p):
        if p.files_done >= 4:
            stop.set()

    first = plan(spec(hub, tmp_path, repo="acme/many", max_workers=2))
    with pytest.raises(DownloadCancelled):
        Download(first, stop=stop, on_progress=on_progress, interval_s=0.02).run()
    mid = plan(spec(hub, tmp_path, repo="acme/many"))
    done = [f.path for f in mid.files if f.done]
    assert 4 <= len(done) < 16
    blobs = tmp_path / "cache/models--acme--many/blobs"
    assert not list(blobs.glob("*.incomplete"))  # the interrupted file left no partial behind
    hub.rate_bps = None
    result = Download(mid).run()
    assert result["files_fetched"] == 16 - len(done)
    for name in done:
        assert len(hub.gets(name)) == 1  # fetched once, in the first run only
    snap = Path(result["path"])
    assert all((snap / n).read_bytes() == d for n, d in hub.repos["acme/many"].files.items())


def test_stall_is_reported(hub, tmp_path):
    hub.rate_bps = 150_000  # a 96 kB file takes ~0.6 s and reports its bytes only at the end
    seen = []
    p = plan(spec(hub, tmp_path, repo="acme/many", include=("shard-00.bin",)))
    Download(p, on_progress=seen.append, interval_s=0.05, stall_s=0.2).run()
    assert any(s.stalled for s in seen) and "STALLED" in next(s for s in seen if s.stalled).line()
    assert not seen[-1].stalled


def test_gated_repo(hub, tmp_path, monkeypatch, no_token_file):
    with pytest.raises(GatedRepo) as err:
        Download(plan(spec(hub, tmp_path, repo="acme/gated"))).run()
    assert "request access at " + hub.url + "/acme/gated" in str(err.value)
    assert "token used: no token" in str(err.value)
    monkeypatch.setenv("HF_TOKEN", BAD_TOKEN)
    with pytest.raises(GatedRepo) as err:
        Download(plan(spec(hub, tmp_path, repo="acme/gated"))).run()
    assert "HF_TOKEN environment variable" in str(err.value) and BAD_TOKEN not in str(err.value)
    assert any(r.authorized for r in hub.requests)
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    result = Download(plan(spec(hub, tmp_path, repo="acme/gated"))).run()
    assert GOOD_TOKEN not in repr(result)
    assert (Path(result["path"]) / "weights.bin").stat().st_size == 4000


def test_missing_repo_revision_and_globs(hub, tmp_path):
    with pytest.raises(RepoNotFound) as err:
        plan(spec(hub, tmp_path, repo="acme/nope"))
    assert err.value.exit_code == 2 and "acme/nope not found" in str(err.value)
    with pytest.raises(RevisionNotFound) as err:
        plan(spec(hub, tmp_path, revision="no-such-branch"))
    assert err.value.exit_code == 2
    with pytest.raises(DownloadInputError) as err:
        plan(spec(hub, tmp_path, include=("*.gguf",)))
    assert "no file of acme/tiny matches" in str(err.value) and err.value.exit_code == 2


@pytest.mark.parametrize("kw", [
    {"repo_id": "not a repo"}, {"repo_id": "a/b/c"}, {"repo_id": ""}, {"repo_id": "acme/tiny", "revision": " "},
    {"repo_id": "acme/tiny", "include": ("/etc/*",)}, {"repo_id": "acme/tiny", "include": ("../x",)},
    {"repo_id": "acme/tiny", "include": ("",)}, {"repo_id": "acme/tiny", "reserve_bytes": -1},
    {"repo_id": "acme/tiny", "max_workers": 0},
])
def test_bad_spec(kw):
    with pytest.raises(DownloadInputError) as err:
        DownloadSpec(**kw)
    assert err.value.exit_code == 2


def test_spec_from_dict_round_trip():
    s = DownloadSpec(repo_id="a/b", include=("*.json",), reserve_bytes=5)
    assert DownloadSpec.from_dict(s.to_dict()) == s
    assert DownloadSpec.from_dict({"repo_id": "a/b", "include": "*.json"}).include == ("*.json",)
    with pytest.raises(DownloadInputError):
        DownloadSpec.from_dict({"repo_id": "a/b", "token": "hf_x"})


def test_hub_unreachable(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HubUnreachable) as err:
        plan(DownloadSpec(repo_id="acme/tiny", endpoint=f"http://127.0.0.1:{port}", cache_dir=str(tmp_path)))
    assert err.value.exit_code == 1 and "cannot reach" in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_permission_denied(hub, tmp_path):
    from ddtree.engine.machine.download import TargetNotWritable

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(TargetNotWritable):
        plan(spec(hub, tmp_path, local_dir=str(locked / "m")))


def _plant_partial(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / name
    part.write_bytes(b"p" * 1000)
    return part


def test_partials_a_killed_download_left_are_removed_on_the_rerun(hub, tmp_path):
    """huggingface_hub writes each file to a per-process `<etag>.<uuid>.incomplete` and deletes it
    only when its own process unwinds: after a kill -9 the partials stayed for ever, unseen by the
    disk check, and the rerun fetched those files again beside them."""
    from filelock import FileLock

    cache = tmp_path / "cache"
    Download(plan(spec(hub, tmp_path, include=("config.json",)))).run()  # the repo's folders exist
    blobs = cache / "models--acme--tiny" / "blobs"
    orphan = _plant_partial(blobs, "f" * 64 + ".0c13e266.incomplete")
    locks = cache / ".locks" / "models--acme--tiny"
    with FileLock(str(locks / ("e" * 64 + ".lock")), timeout=0):  # another process fetches this repo now
        Download(plan(spec(hub, tmp_path, include=("README.md",)))).run()
    assert orphan.exists()  # its partial may be that process's: left alone
    result = Download(plan(spec(hub, tmp_path))).run()
    assert not orphan.exists() and result["partials_removed_bytes"] == 1000
    assert [p.name for p in blobs.iterdir() if p.name.endswith(".incomplete")] == []

    target = tmp_path / "local"
    Download(plan(spec(hub, tmp_path, local_dir=str(target), include=("config.json",)))).run()
    local_orphan = _plant_partial(target / ".cache" / "huggingface" / "download" / "sub",
                                  "abc=." + "f" * 64 + ".1234abcd.incomplete")
    result = Download(plan(spec(hub, tmp_path, local_dir=str(target)))).run()
    assert not local_orphan.exists() and result["partials_removed_bytes"] == 1000
    assert (target / "sub" / "extra.bin").stat().st_size == 50_000


def test_local_dir_refetches_a_file_the_new_revision_changed_at_the_same_size(hub, tmp_path):
    """A file in a local dir counted as done when its size matched: re-downloading after the
    weights were fixed (same shapes, same sizes) fetched nothing and kept the old bytes."""
    from .hub_server import RepoData

    hub.repos["acme/fixed"] = RepoData(files={"config.json": b"{}", "model.safetensors": b"A" * 5000})
    target = tmp_path / "fixed"
    Download(plan(spec(hub, tmp_path, repo="acme/fixed", local_dir=str(target)))).run()
    hub.repos["acme/fixed"] = RepoData(files={"config.json": b"{}", "model.safetensors": b"B" * 5000})
    again = plan(spec(hub, tmp_path, repo="acme/fixed", local_dir=str(target)))
    assert [(f.path, f.done) for f in again.files] == [("config.json", True), ("model.safetensors", False)]
    Download(again).run()
    assert (target / "model.safetensors").read_bytes() == b"B" * 5000
    assert plan(spec(hub, tmp_path, repo="acme/fixed", local_dir=str(target))).files_needed == 0


def test_a_complete_download_is_not_refused_on_a_full_disk(hub, tmp_path):
    """With nothing left to fetch the download cannot fill the disk; it was refused ('needs 0 B
    ... short by ...', exit 1) once the disk sat under the reserve, so a script that makes sure
    its models are there failed on a busy box."""
    Download(plan(spec(hub, tmp_path))).run()
    full = lambda path: (100 * GB, 1 * GB)  # noqa: E731 - under the 10 GB reserve
    again = plan(spec(hub, tmp_path, reserve_bytes=None), usage=full)
    assert again.bytes_needed == 0 and again.disk.ok and again.disk.shortfall == 0
    assert Download(again, usage=full).run()["files_fetched"] == 0
    assert not check_disk(tmp_path, 1, None, usage=full).ok  # a single byte more is still refused


@pytest.mark.parametrize("where", ["cache", "local_dir"])
def test_offline_a_finished_download_is_the_plan(hub, tmp_path, monkeypatch, where):
    """HF_HUB_OFFLINE (or a hub gone away) with a finished download on disk: the plan is that copy,
    from the listing the download noted; nothing on disk means the one-line 'cannot reach' error."""
    from huggingface_hub import constants

    kw = {"local_dir": str(tmp_path / "tiny")} if where == "local_dir" else {"revision": "v1"}
    done = Download(plan(spec(hub, tmp_path, **kw), usage=roomy), usage=roomy).run()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.requests)
    p = plan(spec(hub, tmp_path, **kw), usage=roomy)
    assert len(hub.requests) == requests  # offline means no request at all
    assert p.offline and p.files_needed == 0 and len(p.files) == 5
    assert p.bytes_total == sum(map(len, hub.repos["acme/tiny"].files.values()))
    assert p.commit == hub.repos["acme/tiny"].sha
    assert Download(p, usage=roomy).run()["path"] == done["path"]
    only = plan(spec(hub, tmp_path, include=("*.json",), **kw), usage=roomy)
    assert [f.path for f in only.files] == ["config.json"]
    with pytest.raises(HubUnreachable):
        plan(spec(hub, tmp_path, repo="acme/many"), usage=roomy)
    with pytest.raises(HubUnreachable):  # the globs keep nothing of the copy
        plan(spec(hub, tmp_path, include=("*.gguf",), **kw), usage=roomy)


def test_offline_a_local_folder_of_another_commit_is_not_the_plan(hub, tmp_path, monkeypatch):
    """--revision COMMIT with the hub out of reach: a folder whose files huggingface_hub noted as
    another commit's is not that commit's copy."""
    from huggingface_hub import constants

    kw = {"local_dir": str(tmp_path / "tiny")}
    Download(plan(spec(hub, tmp_path, **kw), usage=roomy), usage=roomy).run()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    sha = hub.repos["acme/tiny"].sha
    assert plan(spec(hub, tmp_path, revision=sha, **kw), usage=roomy).commit == sha
    with pytest.raises(HubUnreachable):
        plan(spec(hub, tmp_path, revision="f" * 40, **kw), usage=roomy)


@pytest.mark.parametrize("where", ["cache", "local_dir"])
def test_offline_an_unfinished_or_partial_copy_is_refused_with_what_is_missing(hub, tmp_path, monkeypatch, where):
    """Files on disk are not a finished download: a subset fetched with --include, or a file gone
    since, is named as missing rather than reported as a complete copy."""
    from huggingface_hub import constants

    kw = {"local_dir": str(tmp_path / "tiny")} if where == "local_dir" else {}
    Download(plan(spec(hub, tmp_path, include=("*.json",), **kw), usage=roomy), usage=roomy).run()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert plan(spec(hub, tmp_path, include=("*.json",), **kw), usage=roomy).files_needed == 0
    with pytest.raises(HubUnreachable) as err:  # all of the repo: only its json came
        plan(spec(hub, tmp_path, **kw), usage=roomy)
    assert "and 4 of the 5 files asked for are not on disk" in str(err.value)
    config = next((tmp_path / ("tiny" if kw else "cache")).rglob("config.json"))
    config.unlink()
    with pytest.raises(HubUnreachable) as err:  # a file gone since
        plan(spec(hub, tmp_path, include=("*.json",), **kw), usage=roomy)
    assert "1 of the 1 files" in str(err.value)


def test_offline_files_that_came_another_way_are_not_a_finished_download(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    folder = tmp_path / "tiny"
    folder.mkdir()
    for name, data in hub.repos["acme/tiny"].files.items():  # copied in by hand: no listing noted
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachable):
        plan(spec(hub, tmp_path, local_dir=str(folder)), usage=roomy)
