"""Disk figures as `df` reports them, from a DiskInfo (total, used, free as shutil.disk_usage gives).

`df` counts used percent against what users can fill: used / (used + available), rounded up, so a
filesystem with a root reserve (ext4 keeps 5% by default) reads fuller than used / size. Free is
what a non-root user can still write (statvfs f_bavail); the reserve is the rest of the free
blocks (f_bfree - f_bavail), there but not for us. No Textual here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiskFigures:
    size: int
    used: int
    #: What a user can still write (df's Avail).
    free: int
    #: Free blocks kept for root (size - used - free).
    reserve: int
    #: df's Use%: used / (used + free), rounded up; None on an empty filesystem.
    used_pct: int | None

    def __post_init__(self) -> None:
        if min(self.size, self.used, self.free, self.reserve) < 0:
            raise ValueError(f"disk figures cannot be negative: {self}")


def disk_figures(total: int, used: int, free: int) -> DiskFigures:
    """From shutil.disk_usage's (total, used, free) or a DiskInfo's fields."""
    usable = used + free
    # -(-a // b) is ceil(a / b) in integers, as df rounds
    pct = None if usable <= 0 else -(-used * 100 // usable)
    return DiskFigures(size=total, used=used, free=free, reserve=max(0, total - used - free), used_pct=pct)
