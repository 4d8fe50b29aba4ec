"""The sweep form covers what a GPU user sets (engine kind, python, backend, GPUs, TP, temperature),
greys out the fields a recipe file overrides, and opens again with the values last started."""

import pytest

from ddtree.console.app import make_app
from ddtree.store import open_db
from ddtree.store.queries import list_runs

from ..support.pilot import open_sweep_form, until

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


@pytest.fixture
def submitted(monkeypatch):
    import ddtree.jobs.start as start

    calls = []
    monkeypatch.setattr(start, "submit_sweep", lambda db_path, run_id, name, **kw: calls.append(run_id) or 7)
    return calls


def _plan(app) -> str:
    return str(app.screen.query_one("#plan").render())


async def test_the_form_sets_the_gpu_fields_and_remembers_them(tmp_path, submitted):
    db_path = tmp_path / "d.db"
    app = make_app(str(db_path), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        await open_sweep_form(app, pilot)
        form = app.screen
        for field_id, value in (("backend", "transformers"), ("tp", "1"), ("temperature", "0, 0.5"),
                                ("budgets", "4"), ("baseline", "")):
            form.query_one(f"#f-{field_id}").value = value
        # the plan of these fields (T=0.5), not the defaults' plan the form showed on opening: until
        # the new one is in, Start is disabled and pressing it does nothing
        await until(pilot, lambda: "Plan (dry run)" in _plan(app) and "T=0.5" in _plan(app), what="the plan")
        form.query_one("#start").press()
        await until(pilot, lambda: len(submitted) == 1, what="the submission")
        with open_db(db_path) as db:
            (run,) = list_runs(db)
        assert run.recipe["engine"]["backend"] == "transformers" and run.recipe["engine"].get("kind", "builtin") == "builtin"
        assert run.recipe["sweep"]["temperature"] == [0.0, 0.5] and run.recipe["sweep"].get("tp", [1]) == [1]

        await open_sweep_form(app, pilot)
        form = app.screen
        assert form.query_one("#f-temperature").value == "0, 0.5"
        assert form.query_one("#f-backend").value == "transformers"
        form.query_one("#f-recipe").value = str(tmp_path / "some.toml")
        # the box posts Changed; the form greys the fields out when it handles it, a turn later
        await until(pilot, lambda: form.query_one("#f-tp").disabled, what="the fields greyed out")
        assert form.query_one("#f-tp").disabled and form.query_one("#f-kind").disabled
        form.query_one("#f-recipe").value = ""
        await until(pilot, lambda: not form.query_one("#f-tp").disabled, what="the fields back")
        assert not form.query_one("#f-tp").disabled


async def test_a_bad_gpu_list_is_one_line_in_the_form(tmp_path):
    app = make_app(str(tmp_path / "d.db"), poll_s=0.1)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        await open_sweep_form(app, pilot)
        app.screen.query_one("#f-gpus").value = "0, x"
        await until(pilot, lambda: "not valid: gpus" in _plan(app), what="the refusal")
        assert app.screen.query_one("#start").disabled


async def test_enter_on_a_refused_form_says_why_at_80x24(tmp_path):
    """The reason sits under the fields, below the fold at 80x24: Enter must not look like nothing."""
    app = make_app(str(tmp_path / "d.db"), poll_s=0.1)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        await open_sweep_form(app, pilot)
        budgets = app.screen.query_one("#f-budgets")
        budgets.value = "-4, abc"
        await until(pilot, lambda: "not valid: budget" in _plan(app), what="the refusal")
        budgets.focus()
        await pilot.press("enter")
        await until(pilot, lambda: any("not valid: budget" in n.message for n in app._notifications),
                    what="the refusal as a notification")
