"""What the console does before and right after its first frame: nothing heavy before it, the
store right after it, panes on their first visit, a bad store reported as one line."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest
from .cockpit_support import NOW, fixed_sources, seed_store, until

from ddtree.console import cli
from ddtree.console.app import make_app
from ddtree.console.screens.modals import HelpScreen

pytestmark = pytest.mark.timeout(90)

EXE = os.path.join(os.path.dirname(sys.executable), "ddtree-console")

FIRST_FRAME = textwrap.dedent(
    """
    import json, sys
    from ddtree.console import cli
    args = cli._console_only(["--db", sys.argv[1]])
    from ddtree.console.app import make_app
    app = make_app(args.db, poll_s=0.1)
    seen = {}
    # engine.units (byte sizes, durations, one-line text for every layer) imports only `re`
    LIGHT = ("ddtree.engine", "ddtree.engine.units")
    def heavy():
        return sorted(m for m in sys.modules if m.split(".")[0] in ("sqlite_utils", "numpy")
                      or m.startswith(("ddtree.store", "ddtree.engine", "ddtree.jobs", "ddtree.console.commands"))
                      and m not in LIGHT)
    def first_frame():
        seen["at_first_frame"] = heavy()
        app.set_interval(0.05, later)
    def later():
        if app.last_snapshot is not None:
            seen["after_store"] = heavy()
            app.exit()
    app.call_after_refresh(first_frame)
    app.run(headless=True, size=(100, 30))
    print(json.dumps(seen))
    """
)


def test_nothing_heavy_before_the_first_frame_and_the_store_right_after(tmp_path):
    db = tmp_path / "ddtree.db"
    seed_store(db)
    out = subprocess.run([sys.executable, "-c", FIRST_FRAME, str(db)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert seen["at_first_frame"] == []
    assert "sqlite_utils" in seen["after_store"] and "ddtree.store.db" in seen["after_store"]


@pytest.mark.parametrize("argv, expected", [
    ([], (None, False)),
    (["--db", "x.db"], ("x.db", False)),
    (["--db=x.db", "--demo"], ("x.db", True)),
    (["--demo", "--db", "x.db"], ("x.db", True)),
])
def test_the_console_path_parses_its_options_without_the_commands(argv, expected):
    args = cli._console_only(argv)
    assert (args.db, args.demo, args.command) == (*expected, None)


@pytest.mark.parametrize("argv", [["jobs"], ["--db", "x.db", "runs"], ["--help"], ["-h"], ["--db"], ["--db="],
                                  ["--bogus"], ["--db", "--demo"]])
def test_anything_else_goes_to_argparse(argv):
    assert cli._console_only(argv) is None


def test_a_bad_store_closes_the_console_with_one_line(tmp_path):
    garbage = tmp_path / "notdb.db"
    garbage.write_bytes(b"\x00\x01not a database at all" * 100)
    before = garbage.read_bytes()
    main, child = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100", LINES="30")
    proc = subprocess.Popen([EXE, "--db", str(garbage)], stdin=child, stdout=child, stderr=child, env=env,
                            start_new_session=True)
    os.close(child)
    screen = b""
    try:
        polls = 600  # reads of up to 0.1 s each: a bound for a loaded box, not a speed claim
        while proc.poll() is None or select.select([main], [], [], 0)[0]:
            polls -= 1
            assert polls > 0, screen[-2000:]
            if select.select([main], [], [], 0.1)[0]:
                try:
                    screen += os.read(main, 65536)
                except OSError:
                    break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(main)
    assert proc.returncode == 2
    assert f"error: {garbage} is not a SQLite database (".encode() in screen
    assert b"Traceback" not in screen
    assert garbage.read_bytes() == before


@pytest.mark.slow
async def test_panes_are_built_on_their_first_visit_and_the_footer_follows_the_focus(tmp_path):
    db = tmp_path / "ddtree.db"
    seed_store(db)
    app = make_app(db, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the store")
        switcher = app.query_one("#panes")
        assert [w.id for w in switcher.children] == ["overview"]
        keys = lambda: str(app.query_one("#keys").render())  # noqa: E731
        assert "Quit" in keys() and "Filter" not in keys()
        assert "palette" in str(app.query_one("#palette-key").render())
        await pilot.press("6")
        assert [w.id for w in switcher.children] == ["overview", "history"]
        await until(pilot, lambda: "Filter" in keys() and "Compare" in keys(), what="the History keys")
        await pilot.press("1", "6")  # built once
        assert [w.id for w in switcher.children] == ["overview", "history"]
        help_at = keys().index(" ? Help")
        await pilot.click("#keys", offset=(help_at + 2, 0))
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("q")
