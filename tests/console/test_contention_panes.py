"""Contention in the console (issue 16): the Hardware pane shows host load and CPU use, the Sweeps
pane's header says when the shown run's points ran on a busy box."""

from __future__ import annotations

import dataclasses

import pytest
from .cockpit_support import NOW, fixed_host, fixed_sources, seed_store, text_of, until

from ddtree.console.app import make_app
from ddtree.store import open_db, sweeps
from ddtree.store.contention import record_contention

pytestmark = pytest.mark.timeout(60)


def app_for(db_path, sources=None):
    return make_app(db_path, poll_s=0.1, clock=lambda: NOW, sources=sources or fixed_sources())


def busy_sources():
    host = dataclasses.replace(fixed_host(), cpus_logical=2, cpu_percent=100.0, load_avg=(5.5, 4.0, 3.0))
    return dataclasses.replace(fixed_sources(), host_info=lambda _folder: host)


async def test_hardware_pane_shows_host_load_and_cpu_use(tmp_path):
    db_path = tmp_path / "ddtree.db"
    seed_store(db_path)
    app = app_for(db_path)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("2")
        await until(pilot, lambda: "load 3.00 2.50 2.00" in text_of(app, "host-load"), what="the host load")
        text = text_of(app, "host-load")
        assert "on 192 CPUs" in text and "CPU use 12%" in text
        assert "busy box" not in text


async def test_hardware_pane_warns_when_load_exceeds_the_cpus(tmp_path):
    db_path = tmp_path / "ddtree.db"
    seed_store(db_path)
    app = app_for(db_path, busy_sources())
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("2")
        await until(pilot, lambda: "load 5.50" in text_of(app, "host-load"), what="the host load")
        text = text_of(app, "host-load")
        assert "CPU use 100%" in text and "busy box" in text


async def test_sweeps_header_notes_a_busy_box(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    with open_db(db_path) as db:
        done = [p for p in sweeps.list_points(db, ids["live_run"]) if p.state == "done"]
        for p in done[:2]:
            record_contention(db, p.id, {"wall_s": 10.0, "cpus": 2, "load1": 5.5, "others_cores": 0.9},
                              ["load 5.5 > 2 cpus", "others 0.90 cores"])
    app = app_for(db_path)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: "busy box" in text_of(app, "sweep-title"), what="the busy note")
        assert "busy box: 2/" in text_of(app, "sweep-title") and "load 5.5" in text_of(app, "sweep-title")


async def test_sweeps_header_is_quiet_without_contended_points(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    app = app_for(db_path)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: f"Run {ids['live_run']}" in text_of(app, "sweep-title"), what="the title")
        assert "busy box" not in text_of(app, "sweep-title")
