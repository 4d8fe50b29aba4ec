"""The sweep form and `ddtree-console sweep` start a sweep through one function (jobs.start), so the
form refuses what the CLI refuses, with the same one line, and nothing reaches the store."""

import pytest

from ddtree.console import cli
from ddtree.console.app import make_app
from ddtree.store import open_db

from ..support.pilot import until

pytestmark = pytest.mark.timeout(90)

MISSING = "/nonexistent/p.jsonl"


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "missing-prompts.toml"
    path.write_text(f'name = "missing-prompts"\n[sweep]\ndataset = "{MISSING}"\nbudget = [4]\n')
    return path


def stored(db_path) -> tuple[int, int]:
    with open_db(db_path) as db:
        return db.execute("SELECT count(*) FROM runs").fetchone()[0], db.execute("SELECT count(*) FROM jobs").fetchone()[0]


def test_the_cli_refuses_a_missing_prompt_file_with_exit_2(tmp_path, recipe, capsys):
    code = cli.main(["--db", str(tmp_path / "d.db"), "sweep", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: sweep.dataset '{MISSING}': prompt file not found: {MISSING}")
    assert err.count("\n") == 1
    assert not (tmp_path / "d.db").exists()


async def test_the_sweep_form_refuses_what_the_cli_refuses(tmp_path, recipe, capsys):
    code = cli.main(["--db", str(tmp_path / "cli.db"), "sweep", str(recipe)])
    cli_line = capsys.readouterr().err.removeprefix("error: ").strip()
    assert code == 2

    db_path = tmp_path / "ddtree.db"
    app = make_app(str(db_path), poll_s=0.1)
    async with app.run_test(size=(140, 45), notifications=True) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        await pilot.press("5", "n")
        await until(pilot, lambda: type(app.screen).__name__ == "SweepForm", what="the sweep form")
        app.screen.query_one("#f-recipe").value = str(recipe)
        # the form plans what was typed with the CLI's checks: the refusal shows before Start
        await until(pilot, lambda: "not valid" in str(app.screen.query_one("#plan").render()), what="the refusal")
        plan_line = " ".join(str(app.screen.query_one("#plan").render()).split())
        assert cli_line in plan_line  # the CLI's line, whatever the wrapping
        assert app.screen.query_one("#start").disabled
        app.screen.query_one("#f-recipe").focus()
        await pilot.press("enter")  # Enter in the form cannot start what was refused
        await pilot.pause()
        assert type(app.screen).__name__ == "SweepForm"
        assert stored(db_path) == (0, 0)
        await pilot.press("escape", "q")
