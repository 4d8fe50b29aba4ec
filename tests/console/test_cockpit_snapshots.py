"""Snapshots of each pane on a store seeded with a realistic sweep (fixed clock, fixed hardware).

Update after an intended change of the look: pytest tests/console/test_cockpit_snapshots.py --snapshot-update
"""

from __future__ import annotations

import pytest

from .cockpit_support import NOW, fixed_sources, seed_store, table_rows, text_of, until, utc  # noqa: F401  (a fixture)

from ddtree.console.app import make_app

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def in_utc(utc):
    """Every test here draws its timestamps in UTC."""


@pytest.fixture
def db_path(tmp_path):
    path = tmp_path / "ddtree.db"
    seed_store(path)
    return path


def ready(check, keys=()):
    async def run_before(pilot) -> None:
        await pilot.press(*keys)  # panes are built on their first visit: go there, then wait
        # for everything the snapshot shows (no fixed pause: the poller's rounds come when they come)
        await until(pilot, lambda: check(pilot.app))

    return run_before


def loaded(app) -> bool:
    return app.last_snapshot is not None and app.hardware is not None and "GPU0" in text_of(app, "gpu-strip")


def points_in(app) -> bool:
    """loaded, and the live run's points too: the poller reads them a round after the run, once the
    console watches it, and until then the Overview's sweep ETA is the run's elapsed time over its
    points done (5m33s, not 2m05s)."""
    return loaded(app) and app.points is not None and bool(app.points[1])


def followed(app) -> bool:
    """Whether the points table shows row 7 first at 80x24; at 120x40 all 14 rows fit."""
    return app.query_one("#points").scroll_offset.y == (7 if app.size.height <= 24 else 0)


CASES = {
    "overview": ([], points_in),
    "hardware": (["2"], lambda app: loaded(app) and len(table_rows(app, "gpus")) == 8),
    "downloads": (["3"], lambda app: loaded(app) and table_rows(app, "download-table")),
    "engines": (["4"], lambda app: loaded(app) and table_rows(app, "engine-table")),
    # Point 10 is in progress: the table scrolls to show it with two finished points above
    # (row 7 first) where it cannot show all 14; checked once the layout has settled.
    "sweeps": (["5"], lambda app: loaded(app) and len(table_rows(app, "points")) == 14
               and app.query_one("#toks-chart").series and followed(app)),
    "history": (["6"], lambda app: loaded(app) and len(table_rows(app, "runs")) == 3),
}


#: Every pane at the smallest size it must work at, and at a roomy one.
SIZES = {"80x24": (80, 24), "120x40": (120, 40)}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("pane", list(CASES))
def test_pane_snapshot(pane, size, db_path, snap_compare):
    keys, check = CASES[pane]
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(), clock=lambda: NOW)
    assert snap_compare(app, terminal_size=SIZES[size], run_before=ready(check, keys))


def test_no_gpu_hardware_snapshot(db_path, snap_compare):
    app = make_app(db_path, poll_s=0.1, sources=fixed_sources(gpus=False), clock=lambda: NOW)
    assert snap_compare(app, terminal_size=(100, 30),
                        run_before=ready(lambda app: app.hardware is not None and "No GPU" in text_of(app, "gpu-reason"),
                                         ["2"]))

