"""Waiting on a Textual pilot for what the console should come to show."""

from __future__ import annotations

import time


async def until(pilot, predicate, timeout: float = 60.0, what: str = "it") -> None:
    """Let the app run until predicate() holds; fail naming `what` after `timeout` seconds. The
    bound only keeps a broken console from hanging the run: a loaded CI box has taken more than
    15 s to settle a pane, so it is far above what a healthy wait takes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause(0.05)
        if predicate():
            return
    raise AssertionError(f"the console never showed {what}")


async def open_sweep_form(app, pilot) -> None:
    """From anywhere: the Sweeps pane (5), then its New sweep form (n)."""
    await pilot.press("5")
    await pilot.press("n")
    await until(pilot, lambda: type(app.screen).__name__ == "SweepForm", what="the sweep form")
