"""Writing an export to a path the operator gave: the one writer for `export -o` and the console.

A regular file (or a missing path) is replaced atomically: a temp file beside it, renamed over it,
so a reader never sees half an export and a failed write leaves the old file. Anything else is
not ours to replace: a character device (/dev/null, a tty) or a FIFO is written into, as a shell
redirect would; a symlink is followed, so the file it points to gets the export and the link
stays. Folders, block devices and sockets are refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ddtree.jobs.errors import JobError


class OutputError(JobError):
    """The export cannot be written where asked."""

    exit_code = 2


def write_output(path: str | os.PathLike, text: str, *, make_parents: bool = False) -> Path:
    """Write `text` (UTF-8) to `path` as described above; the path written (the link's target for a
    symlink). `make_parents` creates missing folders (the console's default folder)."""
    given = Path(path).expanduser()
    target = Path(os.path.realpath(given))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OutputError(f"cannot write {given}: {exc.strerror or exc}") from None
    data = text.encode("utf-8")
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        _write_into(target, given, data)
        return target
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{given} is a folder", "give a file name with -o")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{given} is not a regular file, a character device or a FIFO", "give a file name with -o")
    if not target.parent.is_dir():
        if not make_parents:
            raise OutputError(f"folder {target.parent} does not exist", "create it first, or write elsewhere with -o")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create folder {target.parent}: {exc.strerror or exc}") from None
    _replace(target, given, data, None if st is None else stat.S_IMODE(st.st_mode))
    return target


def _write_into(target: Path, given: Path, data: bytes) -> None:
    """A device or FIFO: opened as it is (no create, no rename), written, closed."""
    try:
        _write_fd(os.open(target, os.O_WRONLY | os.O_NOCTTY), data)
    except OSError as exc:
        raise OutputError(f"cannot write {given}: {exc.strerror or exc}") from None


def _replace(target: Path, given: Path, data: bytes, mode: int | None) -> None:
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        _write_fd(fd, data, mode)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {given}: {exc.strerror or exc}") from None


def _write_fd(fd: int, data: bytes, mode: int | None = None) -> None:
    """All of `data` to `fd` (a pipe takes it in pieces), then the fd closed. `mode`: set it on
    the file, so a replaced file keeps its permissions rather than the umask's."""
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
