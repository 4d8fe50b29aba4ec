"""Keys pressed with no pause between them (issue 17, Keyboard): each burst is posted to the app's
queue in one go, as a terminal delivers fast typing, instead of pilot.press's wait after each key."""

import time

import pytest
from textual import events

from ddtree.console.app import make_app

from ..support.pilot import on_screen, open_sweep_form, until

pytestmark = pytest.mark.timeout(90)

CHARS = {"tab": "\t", "escape": "\x1b", "enter": "\r", "space": " "}


def burst(app, *keys):
    for key in keys:
        app.post_message(events.Key(key, CHARS.get(key, key if len(key) == 1 else None)))


def values(screen):
    return {i.id: i.value for i in screen.query("Input")}


@pytest.mark.slow
async def test_fast_tab_moves_between_sweep_form_fields(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await open_sweep_form(app, pilot)
        burst(app, "tab", *"abc", "tab", *"def", "tab", *"ghi")
        await until(pilot, lambda: values(app.screen)["f-draft"] == "ghi")
        got = values(app.screen)
        assert (got["f-recipe"], got["f-name"], got["f-model"], got["f-draft"]) == ("", "abc", "def", "ghi")
        burst(app, "shift+tab", *"xy")
        await until(pilot, lambda: values(app.screen)["f-model"] == "xy")


def focused_id(app):
    return getattr(app.focused, "id", None)


async def show_pane(app, pilot, key: str, table: str) -> None:
    """The pane of number key `key`, once its table `table` has the focus (so keys reach the pane)."""
    await pilot.press(key)
    await until(pilot, lambda: focused_id(app) == table)


async def test_escape_leaves_the_history_filter_at_once(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await show_pane(app, pilot, "6", "runs")
        burst(app, "slash", *"big", "escape", "s")
        await until(pilot, lambda: app.query_one("#history").sort == 1)
        assert app.query_one("#history-filter").value == "big"  # kept; the s sorted instead
        assert focused_id(app) == "runs"
        burst(app, "slash", "escape", "5")
        await until(pilot, lambda: app.current_pane == "sweeps")
        assert app.query_one("#history-filter").value == "big"


@pytest.mark.slow
async def test_escape_leaves_the_engine_log_search_at_once(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await show_pane(app, pilot, "4", "engine-table")
        burst(app, "slash", *"GET", "escape", "5")
        await until(pilot, lambda: app.current_pane == "sweeps")
        assert app.query_one("#log-search").value == "GET"
        assert app.query_one("#engine-log").search == "GET"
        await show_pane(app, pilot, "4", "engine-table")
        burst(app, "slash")
        await until(pilot, lambda: focused_id(app) == "log-search")
        await pilot.press("end", "backspace", "backspace", "backspace")
        burst(app, "escape")
        # an empty search box goes away
        await until(pilot, lambda: not app.query_one("#log-search").display)
        assert focused_id(app) == "engine-table" and app.query_one("#log-search").value == ""


def confirm_keys(app):
    return str(app.screen.query_one("#confirm-keys").render())


async def test_confirm_dialog_names_its_keys_and_what_enter_does(tmp_path):
    from ddtree.console.screens.modals import ConfirmScreen

    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        answers = []
        app.push_screen(ConfirmScreen("Stop sweep run 3?"), answers.append)
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen) and "Enter" in confirm_keys(app))
        keys = confirm_keys(app)
        assert "y stop it" in keys and "n or Esc keep it running" in keys
        assert keys.rstrip().endswith("Enter: Keep it running")  # a stray Enter stops nothing
        burst(app, "tab")
        await until(pilot, lambda: confirm_keys(app).rstrip().endswith("Enter: Stop it"))
        burst(app, "enter")
        await until(pilot, lambda: answers == [True])


async def test_x_then_enter_says_the_job_was_left_running(tmp_path):
    from ddtree.console.screens.modals import ConfirmScreen

    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        app.confirm_stop(7, "sweep run 3")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        burst(app, "enter")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
        await until(pilot, lambda: any("left running" in n.message for n in app._notifications))


async def test_toasts_expire_soon_are_not_stacked_and_sit_at_the_top(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await pilot.pause()
        for _ in range(3):  # a failure seen on every poll
            app.notify("disk full", title="download failed", severity="error", timeout=120)
        app.notify("started")
        await pilot.pause()
        notes = list(app._notifications)
        assert [n.message for n in notes] == ["disk full", "started"]
        assert all(n.timeout <= 5 for n in notes)
        await until(pilot, lambda: app.screen.query("Toast"))
        for toast in app.screen.query("Toast"):
            assert toast.region.y < 15  # the top half; errors in panes sit low
            assert not toast.region.overlaps(app.query_one("#status").region)


def seed_runs(db_path, tmp_path):
    from ddtree.jobs.model import create_job
    from ddtree.store import open_db
    from ddtree.store.queries import insert_row, update_row

    log = tmp_path / "sweep.log"
    log.write_text("loading model\npoint 1 done\n")
    with open_db(db_path) as db:
        job = create_job(db, "sweep", {}, name="budgets")
        update_row(db, "jobs", job, {"log_path": str(log)})
        ids = []
        for name in ("older", "newer"):
            run = insert_row(db, "runs", {"name": name, "engine_kind": "builtin", "model": "demo/target",
                                          "state": "done", "points_total": 2, "created_at": time.time(),
                                          "job_id": job, "recipe": '{"sweep": {"budget": [4, 16]}}'})
            for idx, budget in enumerate((4, 16)):
                insert_row(db, "points", {"run_id": run, "idx": idx, "algorithm": "ddtree", "budget": budget,
                                          "state": "done", "output_tok_s": 10.0 + budget})
            ids.append(run)
    return ids


async def test_history_enter_opens_the_run_and_space_marks_it(tmp_path):
    from ddtree.console.screens.rundetail import RunScreen

    db_path = str(tmp_path / "ddtree.db")
    seed_runs(db_path, tmp_path)
    app = make_app(db_path, poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: app.query_one("#runs").row_count == 2 and focused_id(app) == "runs")
        burst(app, "space", "space")
        await until(pilot, lambda: len(app.query_one("#history").marked) == 2)
        burst(app, "space")  # the cursor stays on the last row: Space unmarks it
        await until(pilot, lambda: len(app.query_one("#history").marked) == 1)
        burst(app, "enter")
        await until(pilot, lambda: on_screen(app, RunScreen))  # pushed by a worker: composed a turn later
        screen = app.screen
        run_id = app.query_one("#history").current()
        assert screen.run.id == run_id
        # the screen fills its parts after it is shown (a loaded box takes a while): wait for them
        await until(pilot, lambda: screen.query_one("#run-points").row_count == 2, what="the run's points")
        await until(pilot, lambda: "budget" in str(screen.query_one("#run-settings").render()).lower(),
                    what="the run's settings")
        await until(pilot, lambda: "hardware" in str(screen.query_one("#run-env").render()), what="its environment")
        await until(pilot, lambda: "point 1 done" in str(screen.query_one("#run-log").render()), what="its log")
        burst(app, "escape")
        await until(pilot, lambda: not isinstance(app.screen, RunScreen))
        assert len(app.query_one("#history").marked) == 1  # Enter did not touch the selection


async def test_export_dialog_opens_in_the_path_where_enter_exports(tmp_path):
    from ddtree.console.screens.history import ExportForm

    db_path = str(tmp_path / "ddtree.db")
    seed_runs(db_path, tmp_path)
    app = make_app(db_path, poll_s=0.1)
    results = []
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: app.query_one("#runs").row_count == 2)
        app.push_screen(ExportForm(1, tmp_path), results.append)
        await until(pilot, lambda: isinstance(app.screen, ExportForm) and focused_id(app) == "path")
        burst(app, "enter")
        await until(pilot, lambda: results)
        app.push_screen(ExportForm(1, tmp_path), results.append)
        await until(pilot, lambda: isinstance(app.screen, ExportForm) and focused_id(app) == "path")
        await pilot.press("ctrl+u", *"out.md", "enter")  # what is typed is the path, not lost
        await until(pilot, lambda: len(results) == 2)
    fmt_name, path = results[0]
    assert fmt_name == "md" and path.endswith(".md")
    assert results[1] == ("md", "out.md")


@pytest.mark.slow
async def test_sweeps_header_hints_the_run_keys_and_they_switch_runs(tmp_path):
    db_path = str(tmp_path / "ddtree.db")
    older, newer = seed_runs(db_path, tmp_path)
    app = make_app(db_path, poll_s=0.1)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("5")
        title = lambda: str(app.query_one("#sweep-title").render())  # noqa: E731
        await until(pilot, lambda: f"Run {newer} " in title())
        assert "[ ] other runs" not in title() and "keys [ ]: older/newer run" in title()
        burst(app, "left_square_bracket")
        await until(pilot, lambda: f"Run {older} " in title())
        burst(app, "right_square_bracket")
        await until(pilot, lambda: f"Run {newer} " in title())


async def test_sweep_form_sets_repeats_warmup_and_interleave(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await open_sweep_form(app, pilot)
        form = app.screen
        for field_id, text in (("repeats", "3"), ("warmup", "0"), ("interleave", "no")):
            form.query_one(f"#f-{field_id}").value = text
        await pilot.pause()
        data, path = form.recipe_data()
        assert path is None
        assert (data["sweep"]["repeats"], data["sweep"]["warmup"], data["sweep"]["interleave"]) == (3, 0, False)
        form.query_one("#f-interleave").value = "sometimes"
        await until(pilot, lambda: "interleave: yes or no" in str(form.query_one("#plan").render()))


async def test_sweeps_pane_says_which_tau(tmp_path):
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: app.current_pane == "sweeps")
        assert "TAUw" in app.query_one("#points")._labels
        assert "weighted by verify count" in app.query_one("#tau-chart").title


async def test_a_job_started_here_that_fails_says_so(tmp_path):
    """An engine that dies at start only left its pane; the console now says it failed, and why."""
    app = make_app(str(tmp_path / "ddtree.db"), poll_s=0.1)
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        app.submit_job("shell", {"command": "exit 3"}, "fails")
        await until(pilot, lambda: any(n.title.startswith("shell job") and n.title.endswith("failed")
                                       and "status 3" in n.message for n in app._notifications),
                    what="the failure")
        assert not app.started_jobs  # said once
