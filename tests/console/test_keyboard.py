"""Keys pressed with no pause between them (issue 17, Keyboard): each burst is posted to the app's
queue in one go, as a terminal delivers fast typing, instead of pilot.press's wait after each key."""

import time

import pytest
from textual import events

from ddtree.console.app import make_app

pytestmark = pytest.mark.timeout(90)

CHARS = {"tab": "\t", "escape": "\x1b", "enter": "\r", "space": " "}


def burst(app, *keys):
    for key in keys:
        app.post_message(events.Key(key, CHARS.get(key, key if len(key) == 1 else None)))


async def until(pilot, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause(0.05)
        if predicate():
            return
    raise AssertionError("the console never showed it")


def values(screen):
    return {i.id: i.value for i in screen.query("Input")}


async def test_fast_tab_moves_between_sweep_form_fields(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("5")
        await pilot.press("n")
        await until(pilot, lambda: type(app.screen).__name__ == "SweepForm")
        burst(app, "tab", *"abc", "tab", *"def", "tab", *"ghi")
        await until(pilot, lambda: values(app.screen)["f-draft"] == "ghi")
        got = values(app.screen)
        assert (got["f-recipe"], got["f-name"], got["f-model"], got["f-draft"]) == ("", "abc", "def", "ghi")
        burst(app, "shift+tab", *"xy")
        await until(pilot, lambda: values(app.screen)["f-model"] == "xy")


def focused_id(app):
    return getattr(app.focused, "id", None)


async def test_escape_leaves_the_history_filter_at_once(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: focused_id(app) == "runs")
        burst(app, "slash", *"big", "escape", "s")
        await until(pilot, lambda: app.query_one("#history").sort == 1)
        assert app.query_one("#history-filter").value == "big"  # kept; the s sorted instead
        assert focused_id(app) == "runs"
        burst(app, "slash", "escape", "5")
        await until(pilot, lambda: app.current_pane == "sweeps")
        assert app.query_one("#history-filter").value == "big"


async def test_escape_leaves_the_engine_log_search_at_once(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        await until(pilot, lambda: focused_id(app) == "engine-table")
        burst(app, "slash", *"GET", "escape", "5")
        await until(pilot, lambda: app.current_pane == "sweeps")
        assert app.query_one("#log-search").value == "GET"
        assert app.query_one("#engine-log").search == "GET"
        await pilot.press("4")
        await until(pilot, lambda: focused_id(app) == "engine-table")
        burst(app, "slash")
        await until(pilot, lambda: focused_id(app) == "log-search")
        await pilot.press("end", "backspace", "backspace", "backspace")
        burst(app, "escape")
        # an empty search box goes away
        await until(pilot, lambda: not app.query_one("#log-search").display)
        assert focused_id(app) == "engine-table" and app.query_one("#log-search").value == ""
