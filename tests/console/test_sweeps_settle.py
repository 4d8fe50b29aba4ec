"""`e` on the Sweeps pane: the follow-up run that settles the shown run's undecided recommendation,
started through jobs.start like `sweep --settle` (the job's submission is recorded, not run)."""

import pytest

from ddtree.console.app import make_app
from ddtree.store import open_db
from ddtree.store.queries import list_runs

from ..support.pilot import until
from .test_export_verdict import CLEAR, RECIPE, TIED, _seed

pytestmark = pytest.mark.timeout(90)

DEMO = RECIPE.replace('model = "/nowhere/target"\n', "").replace('draft_model = "/nowhere/drafter"\n', "")


@pytest.fixture
def submitted(monkeypatch):
    import ddtree.jobs.start as start

    calls = []
    monkeypatch.setattr(start, "submit_sweep", lambda db_path, run_id, name, **kw: calls.append((run_id, name)) or 99)
    return calls


async def _press_e(db_path):
    app = make_app(str(db_path), poll_s=0.1)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await until(pilot, lambda: app.last_snapshot is not None, what="the first poll")
        await pilot.press("5")
        await until(pilot, lambda: app.shown_run() is not None, what="the run")
        await pilot.press("e")
        await until(pilot, lambda: app.screen.query("Toast"), what="the answer")
        return [str(t.render()) for t in app.screen.query("Toast")]


async def test_e_starts_the_settling_run_of_an_undecided_recommendation(tmp_path, submitted):
    db_path = tmp_path / "d.db"
    run_id = _seed(db_path, TIED, DEMO)
    toasts = await _press_e(db_path)
    assert any("started as job 99" in t for t in toasts), toasts
    with open_db(db_path) as db:
        runs = {r.id: r for r in list_runs(db)}
    (new_id,) = set(runs) - {run_id}
    assert submitted == [(new_id, "repeats-settle")]
    assert runs[new_id].recipe["sweep"]["repeats"] > 3


async def test_e_on_a_decided_run_says_so_and_starts_nothing(tmp_path, submitted):
    db_path = tmp_path / "d.db"
    _seed(db_path, CLEAR, DEMO)
    toasts = await _press_e(db_path)
    assert any("needs no more repeats" in t for t in toasts), toasts
    assert submitted == []


async def test_e_on_a_running_run_says_it_is_still_running_and_starts_nothing(tmp_path, submitted):
    from ddtree.jobs.model import create_job, set_state
    from ddtree.jobs.recipe import parse_recipe, recipe_to_dict
    from ddtree.store import sweeps

    db_path = tmp_path / "d.db"
    recipe = parse_recipe(DEMO)
    with open_db(db_path) as db:  # a run just started by its job: nothing measured yet
        job_id = create_job(db, "sweep", {"run_id": 1}, name=recipe.name)
        for state in ("starting", "running"):
            set_state(db, job_id, state)
        sweeps.create_run(db, job_id=job_id, name=recipe.name, recipe=recipe_to_dict(recipe), engine_kind="builtin")
    toasts = await _press_e(db_path)
    assert any("is still running" in t for t in toasts) and not any("failed" in t for t in toasts), toasts
    assert submitted == []


async def test_e_on_a_run_cancelled_before_its_first_point_says_so_not_that_the_sweep_failed(tmp_path, submitted):
    from ddtree.jobs.model import create_job, set_state
    from ddtree.jobs.recipe import parse_recipe, recipe_to_dict
    from ddtree.store import sweeps

    db_path = tmp_path / "d.db"
    recipe = parse_recipe(DEMO)
    with open_db(db_path) as db:
        job_id = create_job(db, "sweep", {"run_id": 1}, name=recipe.name)
        for state in ("starting", "running"):
            set_state(db, job_id, state)
        set_state(db, job_id, "cancelled", "cancel requested")
        run_id = sweeps.create_run(db, job_id=job_id, name=recipe.name, recipe=recipe_to_dict(recipe),
                                   engine_kind="builtin")
        sweeps.finish_run(db, run_id, "cancelled")
    toasts = await _press_e(db_path)
    assert any("nothing measured yet" in t and "--resume" in t for t in toasts), toasts
    assert not any("failed" in t for t in toasts), toasts
    assert submitted == []
