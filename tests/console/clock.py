"""A clock the console tests move by hand (make_app(clock=...)), so durations and ETAs tick
without waiting."""

from __future__ import annotations

from .cockpit_support import NOW


class Clock:
    """A clock the test moves by hand: `clock.t += 7`."""

    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
