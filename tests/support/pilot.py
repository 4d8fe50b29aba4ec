"""Waiting on a Textual pilot for what the console should come to show."""

from __future__ import annotations

import time


async def until(pilot, predicate, timeout: float = 60.0, what: str = "it") -> None:
    """Let the app run until predicate() holds; fail naming `what` after `timeout` seconds. The
    bound only keeps a broken console from hanging the run: a loaded CI box has taken more than
    15 s to settle a pane, so it is far above what a healthy wait takes.

    Wait on this, never on a fixed pause, for whatever a keypress or click does not finish by
    itself: pilot.press and pilot.click return once the app has handled the event's messages, but
    what a worker thread, a timer (set_interval), the poller or another process brings comes
    later, and so does a message an Input posts when a test sets its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause(0.05)
        if predicate():
            return
    raise AssertionError(f"the console never showed {what}")


def on_screen(app, screen_type) -> bool:
    """Whether a `screen_type` is on screen with its widgets composed. A screen pushed from a
    worker thread (a run's detail, a comparison) is app.screen at once; its compose runs a turn
    of the event loop later, and a query of its widgets before that finds nothing."""
    screen = app.screen
    return isinstance(screen, screen_type) and screen.is_mounted


async def open_sweep_form(app, pilot) -> None:
    """From anywhere: the Sweeps pane (5), then its New sweep form (n)."""
    await pilot.press("5")
    await pilot.press("n")
    await until(pilot, lambda: type(app.screen).__name__ == "SweepForm", what="the sweep form")
