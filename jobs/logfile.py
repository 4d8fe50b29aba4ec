"""Log files of jobs and their children: created owner-only (0600) whatever the umask.

Logs hold command lines, environment-derived paths and engine output; they sit in the data
folder's logs/ (0700), and each file is 0600 too, so a permissive umask (000 gives 0666) or a
folder someone loosened later does not expose them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import IO

LOG_MODE = 0o600


def open_log(path: str | os.PathLike, *, binary: bool = True) -> IO:
    """`path` opened for append, created 0600 if missing; an existing file of ours is set to 0600
    too (one from an older version followed the umask)."""
    fd = os.open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_MODE)
    try:
        if os.fstat(fd).st_mode & 0o777 != LOG_MODE:
            try:
                os.fchmod(fd, LOG_MODE)
            except PermissionError:
                pass  # not ours (a shared log someone pointed us at): leave its mode to its owner
        return os.fdopen(fd, "ab") if binary else os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def create_log(folder: str | os.PathLike, stem: str) -> tuple[Path, IO[bytes]]:
    """A new log file `folder/stem.log` (or `stem.2.log`, `stem.3.log` ... when taken), created
    0600 with O_EXCL and opened for binary append: (its path, the file).

    Never an existing file: two databases in one folder, or a database deleted and made again,
    reuse job ids, and a reader of this launch's output must not find an older launch's lines
    (a stale `listening` line names a dead port).
    """
    folder = Path(folder)
    for n in range(1, 10_000):
        path = folder / (f"{stem}.log" if n == 1 else f"{stem}.{n}.log")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, LOG_MODE)
        except FileExistsError:
            continue
        try:
            if os.fstat(fd).st_mode & 0o777 != LOG_MODE:
                os.fchmod(fd, LOG_MODE)  # the umask filtered the create mode
            return path, os.fdopen(fd, "ab")
        except BaseException:
            os.close(fd)
            raise
    raise FileExistsError(f"no free log name for {stem} in {folder}")


# A tqdm bar ("Loading weights:  45%|####5     | 9/20 [00:01<00:02, 4.5it/s]"): updates are
# separated by carriage returns, so one "line" of the log may be hundreds of them.
_BAR = re.compile(r"\d+%\|.*\||\|\s*\d+/\d+\s*\[|\d+(?:\.\d+)?(?:it|s)/(?:s|it)\]")
_ERROR = re.compile(r"^(?:error:|ERROR\b|\w+(?:Error|Exception)\b:?)")


def error_tail(text: str, lines: int = 3, width: int = 400) -> str:
    """The part of a child's log worth putting in an error message: progress bars dropped, then the
    last line that reads as an error (`error: ...`, `ValueError: ...`), else the last `lines` lines;
    each kept line at most `width` characters from its start (the cause comes first)."""
    kept = [line.strip() for line in re.split(r"[\r\n]+", text)]
    kept = [line for line in kept if line and not _BAR.search(line)]
    errors = [line for line in kept if _ERROR.match(line)]
    chosen = errors[-1:] if errors else kept[-lines:]
    return " | ".join(line[:width] for line in chosen)
