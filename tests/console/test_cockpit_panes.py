"""Pilot tests of every pane and form, by keys and by mouse, on a real SQLite store seeded with a
realistic sweep through the store's own write functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from .cockpit_support import NOW, fixed_sources, on_screen, seed_store, table_rows, text_of, until
from .row_logs import log_of

from ddtree.console.app import make_app
from ddtree.console.screens.downloads import COLUMNS as DOWNLOAD_COLUMNS, DownloadForm
from ddtree.console.screens.engines import COLUMNS, EngineForm
from ddtree.console.screens.history import CompareScreen, ExportForm
from ddtree.console.screens.modals import ConfirmScreen, HelpScreen
from ddtree.console.screens.sweeps import SweepForm
from ddtree.console.widgets.chart import LineChart
from ddtree.store import open_db
from ddtree.store.queries import get_job

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def seeded(tmp_path):
    db_path = tmp_path / "ddtree.db"
    ids = seed_store(db_path)
    return db_path, ids


def app_for(db_path, **kw):
    kw.setdefault("sources", fixed_sources())
    return make_app(db_path, poll_s=0.1, clock=lambda: NOW, **kw)


@pytest.fixture
def app(seeded):
    """The console on the seeded store, with the fixed sources and clock."""
    return app_for(seeded[0])


@pytest.fixture
def submitting_app(app, monkeypatch):
    """The seeded store's app, and the (kind, spec) of each job its forms submit: recorded, not started."""
    submitted = []
    monkeypatch.setattr(type(app), "submit_job", lambda self, kind, spec, name=None: submitted.append((kind, spec)))
    return app, submitted


def form_error(form) -> str:
    """The line under a form: why Start is disabled, or what will run."""
    return str(form.query_one("#form-error").render())


def palette_highlights(app, text: str) -> bool:
    """Whether the command palette is open with an entry containing `text` highlighted."""
    from textual.command import CommandList, CommandPalette

    if not isinstance(app.screen, CommandPalette):
        return False
    matches = app.screen.query_one(CommandList)
    at = matches.highlighted
    return at is not None and text in str(matches.get_option_at_index(at).prompt)


async def test_overview_jobs_gpu_strip_disks(seeded, app):
    _, ids = seeded
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: len(table_rows(app, "jobs")) == 3, what="the jobs")
        # 9 of 14 points, each took 25 s: 5 to go is 2m05s (once the points are in; before, the
        # run's elapsed time over its points done)
        sweep = lambda: {r[0]: r for r in table_rows(app, "jobs")}[str(ids["sweep_job"])]  # noqa: E731
        await until(pilot, lambda: sweep()[6] == "2m05s", what="the sweep's ETA from its points")
        rows = {r[0]: r for r in table_rows(app, "jobs")}
        assert rows[str(ids["sweep_job"])][3:7] == ["running", "9/14 pts", "10m00s", "2m05s"]
        assert rows[str(ids["sweep_job"])][7] == "point 10/14"
        await until(pilot, lambda: "GPU0" in text_of(app, "gpu-strip"), what="the GPU strip")
        assert "GPU7" in text_of(app, "gpu-strip")
        await until(pilot, lambda: "models (HF cache)" in text_of(app, "disks"), what="the disks")
        assert "1.7 TB free of 3.8 TB" in text_of(app, "disks")


async def test_without_gpu_the_hardware_pane_says_so_and_why(seeded):
    db_path, _ = seeded
    app = app_for(db_path, sources=fixed_sources(gpus=False))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("2")
        assert app.current_pane == "hardware"
        await until(pilot, lambda: "No GPU" in text_of(app, "gpu-reason"), what="the no-GPU reason")
        assert "no NVIDIA driver" in text_of(app, "gpu-reason")
        assert "node 1: CPUs 96-191" in text_of(app, "numa")
        assert "No GPU: NVML library not found" in text_of(app, "gpu-strip")


async def test_hardware_pane_gpus_links_numa_and_placement(app):
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("2")
        await until(pilot, lambda: len(table_rows(app, "gpus")) == 8, what="the GPU table")
        links = text_of(app, "links")
        assert "GPU7" in links and "SYS" in links and "across NUMA nodes" in links
        assert "GPUs 4, 5, 6, 7" in text_of(app, "numa")
        assert "GPUs with unknown NUMA node: 3" in text_of(app, "numa")
        await until(pilot, lambda: "1. GPUs" in text_of(app, "placements"), what="placements")
        tp = app.query_one("#tp")
        tp.value = ""  # the box posts Changed: its handler runs a turn later
        await until(pilot, lambda: "must be an integer" in text_of(app, "placements"), what="the TP refusal")
        assert "must be an integer" in text_of(app, "placements")
        await pilot.click("#tp")
        await pilot.press("4")
        await until(pilot, lambda: "1. GPUs" in text_of(app, "placements"), what="TP 4 placements")
        first = text_of(app, "placements").splitlines()[0]
        assert first.startswith("1. GPUs") and first.split()[2].count(",") == 3
        tp.value = "9"
        await until(pilot, lambda: "needs 9 GPUs" in text_of(app, "placements"), what="TP 9 refused")
        assert "needs 9 GPUs" in text_of(app, "placements")


@pytest.mark.slow
async def test_downloads_pane_form_validates_as_typed(submitting_app):
    app, submitted = submitting_app
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("3")
        await until(pilot, lambda: table_rows(app, "download-table"), what="the download")
        row = table_rows(app, "download-table")[0]
        row = dict(zip(DOWNLOAD_COLUMNS, row))
        assert row["REPO"] == "Qwen/Qwen3-8B" and row["PROGRESS"].endswith("37%") and row["RATE"] == "85.0 MB/s"
        assert row["FREE AFTER"] == "401.7 GB"  # free now minus what is still to come
        assert row["BYTES"] == "6.1 GB/16.4 GB" and row["FILES"] == "4/12"
        await pilot.click("#new-download")  # the mouse opens the form too
        assert isinstance(app.screen, DownloadForm)
        form = app.screen
        await pilot.press(*"not a repo")
        assert form.query_one("#start").disabled
        assert "not a Hugging Face repo id" in form_error(form)
        form.query_one("#repo").value = ""
        form.query_one("#repo").value = "Qwen/Qwen3-0.6"
        await pilot.press("end", "B", "tab", *"../x")
        assert form.query_one("#start").disabled and "bad glob" in form_error(form)
        form.query_one("#include").value = "*.json, *.safetensors"
        form.query_one("#revision").value = "a b"
        await until(pilot, lambda: "not a valid revision" in form_error(form), what="the bad revision")
        assert form.query_one("#start").disabled and "not a valid revision" in form_error(form)
        form.query_one("#revision").value = "v2"
        form.query_one("#exclude").value = "/abs"
        await until(pilot, lambda: "exclude: " in form_error(form), what="the bad exclude glob")
        assert form.query_one("#start").disabled and "bad glob" in form_error(form)
        form.query_one("#exclude").value = "*.pth"
        form.query_one("#reserve").value = "-3"
        # still disabled, as for the glob before: wait for the reserve's own refusal
        await until(pilot, lambda: form_error(form).startswith("reserve: "), what="the negative reserve refused")
        assert form.query_one("#start").disabled
        form.query_one("#reserve").value = "20"
        await until(pilot, lambda: not form.query_one("#start").disabled, what="the valid form")
        assert not form.query_one("#start").disabled
        await pilot.press("enter")
        assert not isinstance(app.screen, DownloadForm)
        assert submitted == [("download", {"repo_id": "Qwen/Qwen3-0.6B", "include": ["*.json", "*.safetensors"],
                                           "exclude": ["*.pth"], "revision": "v2",
                                           "reserve_bytes": 20_000_000_000})]
        from ddtree.jobs.kinds.download import validate

        validate(submitted[0][1])  # what the form hands over is a valid job spec


@pytest.mark.parametrize("form_key", [("3", "d"), ("4", "n")])
async def test_a_form_fits_80x24_buttons_and_all(app, form_key):
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press(*form_key)
        await until(pilot, lambda: app.screen.query("Button") and all(b.region for b in app.screen.query("Button")),
                    what="the form laid out")
        for button in app.screen.query("Button"):
            region = button.region
            assert region.height and region.bottom <= 24, (button.id, region)


async def test_stopping_asks_first_then_cancels_the_job(seeded, app):
    db_path, ids = seeded
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("3")
        await until(pilot, lambda: table_rows(app, "download-table"), what="the download")
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        with open_db(db_path) as db:
            assert get_job(db, ids["download_job"]).state == "running"
        await pilot.click("#stop-download")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.click("#yes")

        def cancelled():
            with open_db(db_path) as db:
                return get_job(db, ids["download_job"]).state == "cancelled"

        await until(pilot, cancelled, what="the cancel")
        await until(pilot, lambda: any(r[3] == "cancelled" for r in table_rows(app, "jobs")), what="the new state")


@pytest.mark.slow
async def test_engines_pane_health_and_log_follow_search_wrap(seeded, tmp_path):
    db_path, ids = seeded
    log = log_of(db_path, "engines", 1, tmp_path / "server.log", "loading model\nwarm-up done\nERROR something odd\n")
    app = app_for(db_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("4")
        await until(pilot, lambda: table_rows(app, "engine-table"), what="the engine")
        row = dict(zip(COLUMNS, table_rows(app, "engine-table")[0]))
        assert row == {"JOB": str(ids["engine_job"]), "MODEL": "demo/target", "ALGO": "ddtree", "BUDGET": "32",
                       "STATE": "running", "HEALTH": "ok", "UPTIME": "14m40s", "PORT": "40123", "GPUS": "cpu",
                       "KIND": "builtin", "BACKEND": "transformers"}
        view = app.query_one("#engine-log")
        await until(pilot, lambda: len(view.raw_lines) == 3, what="the log")
        with log.open("a") as fh:
            fh.write("request 1 done\n")
        await until(pilot, lambda: view.raw_lines[-1] == "request 1 done", what="the new log line")
        await pilot.press("slash", *"error", "enter")
        assert view.search == "error"
        assert len(view.lines) == 1  # one rendered line: only the match
        await pilot.press("w")
        assert view.wrap
        await pilot.press("f")
        assert not view.auto_scroll
        assert "(wrap)" in text_of(app, "log-title") and "search 'error'" in text_of(app, "log-title")


@pytest.mark.slow
async def test_engine_form_validates_and_returns_a_job_spec(submitting_app, tmp_path):
    app, submitted = submitting_app
    (tmp_path / "target").mkdir()
    (tmp_path / "drafter").mkdir()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("4", "n")
        assert isinstance(app.screen, EngineForm)
        form = app.screen
        form.query_one("#model").value = str(tmp_path / "missin")
        await pilot.press("end", "g")  # typed: validated on every change
        assert form.query_one("#start").disabled
        assert "not found" in form_error(form)
        form.query_one("#model").value = str(tmp_path / "target")
        form.query_one("#draft").value = str(tmp_path / "drafter")
        form.query_one("#budget").value = "16"
        form.query_one("#device").value = "gpu0"
        await until(pilot, lambda: "device" in form_error(form), what="the bad device")
        assert form.query_one("#start").disabled and "device" in form_error(form)
        form.query_one("#device").value = "cpu"
        await until(pilot, lambda: not form.query_one("#start").disabled, what="the valid form")
        assert not form.query_one("#start").disabled
        assert form.query_one("#row-backend").display and "on cpu, backend auto" in form_error(form)
        form.query_one("#backend").value = "fast"
        await until(pilot, lambda: "backend fast" in form_error(form), what="the fast backend")
        assert "on cpu, backend fast" in form_error(form)  # the preview says what will run
        await pilot.click("#start")
        assert submitted and submitted[0][0] == "engine"
        assert submitted[0][1]["budget"] == 16 and submitted[0][1]["model"] == str(tmp_path / "target")
        assert submitted[0][1]["backend"] == "fast"


@pytest.mark.slow
async def test_engine_form_refuses_speculation_on_a_hybrid_target_before_it_starts(submitting_app, tmp_path):
    app, submitted = submitting_app
    (tmp_path / "next").mkdir()
    (tmp_path / "next" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}))
    (tmp_path / "drafter").mkdir()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("4", "n")
        form = app.screen
        form.query_one("#model").value = str(tmp_path / "next")
        form.query_one("#draft").value = str(tmp_path / "drafter")
        await until(pilot, lambda: "refuses ddtree" in form_error(form), what="ddtree refused")
        assert form.query_one("#start").disabled
        assert "refuses ddtree" in form_error(form) and "linear_attention" in form_error(form) and "extra_buffer" in form_error(form)
        form.query_one("#algorithm").value = "dflash"
        await until(pilot, lambda: "refuses dflash" in form_error(form), what="dflash refused")
        assert form.query_one("#start").disabled and "refuses dflash" in form_error(form)
        form.query_one("#algorithm").value = "ar"
        await until(pilot, lambda: not form.query_one("#start").disabled, what="ar taken")
        assert not form.query_one("#start").disabled and "will run: builtin" in form_error(form)
        await pilot.click("#start")
    assert submitted and submitted[0][1]["algorithm"] == "ar"


async def test_engine_form_refuses_cuda_on_a_machine_without_a_gpu(seeded, monkeypatch):
    """The Hardware pane's NVML reading says there is no GPU: device cuda is refused in the form,
    with the reason, and Enter says it in a toast, instead of a job that fails at start."""
    db_path, _ = seeded
    app = app_for(db_path, sources=fixed_sources(gpus=False))
    submitted = []
    monkeypatch.setattr(type(app), "submit_job", lambda self, kind, spec, name=None: submitted.append((kind, spec)))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.gpu_view is not None, what="the hardware view")
        await pilot.press("4", "n")
        await until(pilot, lambda: isinstance(app.screen, EngineForm), what="the engine form")
        form = app.screen
        form.query_one("#device").value = "cuda"
        await until(pilot, lambda: "no GPU" in form_error(form), what="cuda refused")
        assert form.query_one("#start").disabled
        assert "no GPU" in form_error(form) and "NVML library not found" in form_error(form)
        assert "\n" not in form_error(form).strip()  # one line
        form.query_one("#device").focus()
        await pilot.press("enter")
        assert isinstance(app.screen, EngineForm) and not submitted
        # the toast is a message of its own: it reaches app._notifications a turn after the key
        await until(pilot, lambda: any(n.title == "cannot start" and "no GPU" in n.message
                                       for n in app._notifications), what="the refusal as a toast")
        assert any(n.title == "cannot start" and "no GPU" in n.message for n in app._notifications)
        form.query_one("#device").value = "cpu"
        await until(pilot, lambda: not form.query_one("#start").disabled, what="cpu taken")
        assert not form.query_one("#start").disabled and "will run: builtin" in form_error(form)


async def test_engine_form_takes_a_gpu_that_is_there_and_refuses_one_that_is_not(seeded, app):
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.gpu_view is not None, what="the hardware view")
        count = len(app.gpu_view.gpus)
        await pilot.press("4", "n")
        await until(pilot, lambda: isinstance(app.screen, EngineForm), what="the engine form")
        form = app.screen
        form.query_one("#device").value = "cuda:0"
        await until(pilot, lambda: "on cuda:0" in form_error(form), what="cuda:0 taken")
        assert not form.query_one("#start").disabled and "on cuda:0" in form_error(form)
        form.query_one("#device").value = f"cuda:{count}"
        await until(pilot, lambda: f"no GPU {count} here" in form_error(form), what=f"cuda:{count} refused")
        assert form.query_one("#start").disabled and f"no GPU {count} here" in form_error(form)


@pytest.mark.slow
async def test_engine_form_starts_sglang_on_chosen_gpus(submitting_app, tmp_path):
    app, submitted = submitting_app
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4", "n")
        form = app.screen
        assert not form.query_one("#row-python").display and form.query_one("#row-device").display
        form.query_one("#kind").value = "sglang"
        await until(pilot, lambda: form.query_one("#row-python").display, what="the sglang fields")
        assert form.query_one("#row-python").display and not form.query_one("#row-device").display
        assert not form.query_one("#row-backend").display  # a builtin-only choice
        assert form.query_one("#start").disabled and "needs model and python" in form_error(form)
        form.query_one("#model").value = "Qwen/Qwen3-8B"
        form.query_one("#draft").value = "z-lab/Qwen3-8B-DFlash-b16"
        form.query_one("#algorithm").value = "dflash"
        form.query_one("#python").value = str(python)
        await until(pilot, lambda: "not found or not executable" in form_error(form), what="the python refused")
        assert "not found or not executable" in form_error(form)  # not executable yet
        python.chmod(0o755)
        form.query_one("#gpus").value = "0, x"
        await until(pilot, lambda: "gpus must be a list" in form_error(form), what="the bad GPU list")
        assert "gpus must be a list" in form_error(form)
        form.query_one("#gpus").value = "2,3"
        await until(pilot, lambda: not form.query_one("#start").disabled, what="GPUs 2,3 taken")
        assert not form.query_one("#start").disabled
        assert ("will run: sglang Qwen/Qwen3-8B with drafter z-lab/Qwen3-8B-DFlash-b16, dflash, block the drafter's, "
                "on GPUs 2,3, TP 2") in form_error(form)  # TP follows the GPUs until one is typed
        assert form.query_one("#row-tp").display
        form.query_one("#tp").value = "1"
        await until(pilot, lambda: "TP 1" in form_error(form), what="TP 1 taken")
        assert "on GPUs 2,3, TP 1" in form_error(form)
        await pilot.click("#start")
        # the form remembers what was started
        await pilot.press("n")
        form = app.screen
        assert form.query_one("#kind").value == "sglang" and form.query_one("#gpus").value == "2,3"
        assert form.query_one("#model").value == "Qwen/Qwen3-8B" and form.query_one("#tp").value == "1"
        await pilot.press("escape")
    assert submitted == [("engine", {"kind": "sglang", "algorithm": "dflash", "python": str(python), "gpus": [2, 3],
                                     "model": "Qwen/Qwen3-8B", "draft_model": "z-lab/Qwen3-8B-DFlash-b16", "tp": 1})]


async def test_sweeps_pane_curves_baselines_best_and_points(seeded, app):
    db_path, ids = seeded
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("5")
        await until(pilot, lambda: len(table_rows(app, "points")) == 14, what="the points")
        tok = app.query_one("#toks-chart", LineChart)
        await until(pilot, lambda: tok.series, what="the curves")
        measured = [s for s in tok.series if not s.reference]
        assert [s.label for s in measured] == ["c=1"]
        assert measured[0].best == (32.0, 77.5)
        assert {s.label for s in tok.series if s.reference} == {"AR", "DFlash"}
        tau = app.query_one("#tau-chart", LineChart)
        assert [p for p in tau.series[0].points][-1] == (64.0, pytest.approx(4.5 * 1.02))
        # one repeat per budget: the highest is named, but not called best (no interval to tell it from noise)
        best = text_of(app, "best")
        assert "highest budget 32 at 77.5 tok/s, untested" in best and "(3.52x AR, 1.41x DFlash)" in best
        assert "Run 3 k26-ddtree (running) 9/14" in text_of(app, "sweep-title")
        # a point lands: the table and the curve follow on the next poll
        from .cockpit_support import metrics_for

        from ddtree.store import sweeps

        with open_db(db_path) as db:
            pending = [p for p in sweeps.list_points(db, ids["live_run"]) if p.state == "pending"][0]
            sweeps.record_point(db, pending.id, state="done", metrics=metrics_for("ddtree", pending.budget, 4),
                                requests=[])
        await until(pilot, lambda: len([s for s in tok.series if not s.reference]) == 2, what="the c=4 line")
        await pilot.press("left_square_bracket")
        await until(pilot, lambda: "Run 2 yesterday" in text_of(app, "sweep-title"), what="the older run")
        await until(pilot, lambda: len(table_rows(app, "points")) == 7, what="its points")
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: "Run 3" in text_of(app, "sweep-title"), what="the newer run")


@pytest.mark.slow
async def test_sweep_form_shows_the_plan_and_refuses_bad_input(seeded, tmp_path, monkeypatch):
    db_path, _ = seeded
    app = app_for(db_path)
    started = []
    monkeypatch.setattr(type(app), "start_sweep", lambda self, spec: started.append(spec))
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[sweep]\nbudgit = [4]\n')
    good = tmp_path / "good.toml"
    good.write_text('name = "from-file"\n[engine]\nkind = "builtin"\n[sweep]\nbudget = [8, 32]\nnum_prompts = 4\n')
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.press("5", "n")
        assert isinstance(app.screen, SweepForm)
        form = app.screen
        plan = lambda: str(form.query_one("#plan").render())  # noqa: E731
        await until(pilot, lambda: "Plan (dry run)" in plan(), what="the first plan")
        assert "sweep 'demo-budgets'" in plan()
        form.query_one("#f-budgets").value = "4, x"
        await until(pilot, lambda: "not valid" in plan(), what="the bad budgets")
        assert form.query_one("#start").disabled
        form.query_one("#f-budgets").value = "4, 8"
        form.query_one("#f-concurrency").value = "0"
        await until(pilot, lambda: "sweep.concurrency[0] must be >= 1" in plan(), what="the bad concurrency")
        form.query_one("#f-concurrency").value = "1"
        form.query_one("#f-recipe").value = str(bad)
        await until(pilot, lambda: "did you mean 'budget'" in plan(), what="the typo")
        assert form.query_one("#start").disabled
        form.query_one("#f-recipe").value = str(good)
        await until(pilot, lambda: "sweep 'from-file'" in plan(), what="the recipe file's plan")
        assert not form.query_one("#start").disabled
        await pilot.click("#start")
        assert started and started[0]["recipe"]["name"] == "from-file"
        assert started[0]["recipe_path"] == str(good.resolve()) and started[0]["points_total"] == 2


@pytest.mark.slow
async def test_sweep_form_plans_in_a_thread_one_at_a_time_newest_input_last(seeded, monkeypatch):
    import threading

    import ddtree.jobs.start as start_module

    db_path, _ = seeded
    real, gate, calls, running, peak = start_module.make_plan, threading.Event(), [], [0], [0]

    def slow_plan(recipe, **kwargs):  # stands in for a plan that probes an SGLang interpreter
        calls.append(recipe.name)
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        gate.wait(10)
        running[0] -= 1
        return real(recipe, **kwargs)

    monkeypatch.setattr(start_module, "make_plan", slow_plan)  # the form plans through jobs.start
    app = app_for(db_path)
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.press("5", "n")
        form = app.screen
        await until(pilot, lambda: calls == ["demo-budgets"], what="the first plan under way")
        for name in ("a", "ab", "abc"):  # typed while it runs: the UI answers, the input waits
            form.query_one("#f-name").value = name
            # each is handled (queued behind the running plan) before the next: not a fixed pause
            await until(pilot, lambda: form._pending is not None and form._pending[1]["name"] == name,
                        what=f"{name!r} queued")
        assert form.query_one("#f-name").value == "abc" and form.query_one("#start").disabled
        gate.set()
        plan = lambda: str(form.query_one("#plan").render())  # noqa: E731
        await until(pilot, lambda: "sweep 'abc'" in plan(), what="the newest input's plan")
        assert calls == ["demo-budgets", "abc"] and peak[0] == 1
        assert not form.query_one("#start").disabled


@pytest.mark.slow
async def test_history_filter_sort_compare_export(seeded, tmp_path):
    db_path, ids = seeded
    app = app_for(db_path)
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: len(table_rows(app, "runs")) == 3, what="the runs")
        assert [r[1] for r in table_rows(app, "runs")] == ["k26-ddtree", "yesterday", "last-week"]
        await pilot.press("slash", *"week")
        await until(pilot, lambda: len(table_rows(app, "runs")) == 1, what="the filtered run")
        app.query_one("#history-filter").value = ""
        await until(pilot, lambda: len(table_rows(app, "runs")) == 3, what="all runs again")
        await pilot.press("escape")
        app.query_one("#runs").focus()
        await pilot.press("s")  # oldest first
        await until(pilot, lambda: table_rows(app, "runs")[0][1] == "last-week", what="the sorted runs")
        await pilot.press("space", "space")  # marks last-week and yesterday
        assert app.query_one("#history").marked == {ids["old_run"], ids["prev_run"]}
        await pilot.press("c")
        await until(pilot, lambda: on_screen(app, CompareScreen), what="the comparison")
        screen = app.screen
        assert "hardware differs" in str(screen.query_one("#hw-warning").render())
        metrics = str(screen.query_one("#metrics").render())
        assert "77.50 (+25%)" in metrics  # yesterday vs last week's 0.8x figures
        overlaid = screen.query_one("#cmp-toks", LineChart).series
        assert {s.label for s in overlaid} == {f"r{ids['old_run']} c=1", f"r{ids['prev_run']} c=1"}
        await pilot.press("escape")
        await pilot.press("e")
        assert isinstance(app.screen, ExportForm)
        target = tmp_path / "out" / "run.csv"
        app.screen.query_one("#format").value = "csv"
        app.screen.query_one("#path").value = str(target)
        await pilot.click("#start")
        await until(pilot, target.exists, what="the export")
        assert target.read_text().startswith("id,run_id")


async def test_compare_needs_two_runs(app):
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("6")
        await until(pilot, lambda: len(table_rows(app, "runs")) == 3, what="the runs")
        await pilot.press("c")
        assert not isinstance(app.screen, CompareScreen)
        # the toast is a message of its own: it reaches app._notifications a turn after the key
        await until(pilot, lambda: any("select two or more" in n.message for n in app._notifications),
                    what="the warning")
        assert any("select two or more" in n.message for n in app._notifications)


@pytest.mark.slow
async def test_keys_palette_help_maximise_theme_and_tabs_by_mouse(app):
    async with app.run_test(size=(80, 24)) as pilot:
        for key, pane in zip("123456", ("overview", "hardware", "downloads", "engines", "sweeps", "history")):
            await pilot.press(key)
            assert app.current_pane == pane
            assert app.query_one("#panes").current == pane
        await pilot.click("#tab-sweeps")
        assert app.current_pane == "sweeps"
        await pilot.press("m")
        assert app.screen.maximized is app.query_one("#sweeps")
        await pilot.press("m")
        assert app.screen.maximized is None
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        dark = app.theme
        await pilot.press("t")
        assert app.theme != dark
        await pilot.press("ctrl+p")
        await pilot.press(*"to Downl")
        # the palette gathers its matches on a worker: Enter once the one wanted is highlighted
        await until(pilot, lambda: palette_highlights(app, "Go to Downloads"), what="the palette's match")
        await pilot.press("enter")
        await until(pilot, lambda: app.current_pane == "downloads", what="the palette's pane")
        await pilot.press("q")
    assert app.return_code == 0


@pytest.mark.slow
def test_console_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, asyncio\n"
            "from ddtree.console import cli\n"
            "from ddtree.console.app import make_app\n"
            "async def main():\n"
            "    app = make_app(sys.argv[1], poll_s=0.1)\n"
            "    async with app.run_test() as pilot:\n"
            "        for key in '123456':\n"
            "            await pilot.press(key)\n"
            "            await pilot.pause(0.05)\n"
            "asyncio.run(main())\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'safetensors', 'tokenizers'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__import__("tempfile").mkdtemp()) / "x.db")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


async def test_help_lines_too_long_for_the_dialog_go_on_under_their_text(app):
    """At 80x24 the help's longer lines wrap: the rest goes under the text, not back to the left
    edge under the keys (where it read as a key of its own)."""
    from textual.geometry import Region

    from ddtree.console.screens.modals import HELP_KEY_W

    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
        body = app.screen.query_one("#help Static")
        await until(pilot, lambda: body.size.height > 20, what="the help laid out")
        lines = [strip.text.rstrip() for strip in body.render_lines(Region(0, 0, body.size.width, body.size.height))]
        at = lambda text: next(i for i, line in enumerate(lines) if text in line)  # noqa: E731
        assert not lines[at("2     Hardware")].endswith("sets")  # 'suggested GPU sets' does not fit...
        assert lines[at("2     Hardware") + 1] == " " * (HELP_KEY_W + 11) + "sets"  # ...and goes on under its text
        theme = at("Dark / light theme")
        assert lines[theme + 1].startswith(" " * HELP_KEY_W) and lines[theme + 1].strip()
        # each line: a section title at the left edge, a key's line, or the rest of a text under it
        titles = {"Panes", "Everywhere", "Overview", "Downloads", "Engines", "Sweeps", "History"}
        for line in lines[at("Panes"):at("Jobs run detached")]:
            assert not line or line.startswith("  ") or line in titles, line


async def test_tabs_fit_a_narrow_terminal_with_shorter_titles(app):
    """At 60 columns the six tabs (69 columns with their full titles) would cut '6 History' to '6':
    Hardware and Downloads take short titles there, and their full ones back on a wider terminal."""
    from textual.widgets import Tabs

    def labels() -> list[str]:
        return [tab.label_text for tab in app.query_one("#pane-tabs", Tabs).query("Tab")]

    def bar_width() -> int:
        return sum(tab.outer_size.width for tab in app.query_one("#pane-tabs", Tabs).query("Tab"))

    async with app.run_test(size=(60, 20)) as pilot:
        await until(pilot, lambda: "2 HW" in labels(), what="the short titles")
        assert labels() == ["1 Overview", "2 HW", "3 DL", "4 Engines", "5 Sweeps", "6 History"]
        await pilot.pause()
        assert bar_width() <= 60
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: "2 Hardware" in labels(), what="the full titles")
        assert labels()[2] == "3 Downloads"
        await pilot.pause()
        assert bar_width() <= 80


async def test_the_key_bar_shows_whole_keys_only_on_a_narrow_terminal(app):
    """At 60 columns the Engines keys do not all fit: the bar leaves whole keys out instead of
    cutting one ('/ Searc'), keeps help and quit (they came last and fell off), and shows them
    all again when the terminal widens."""
    def keys() -> str:
        return str(app.query_one("#keys").render()).rstrip()

    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        await until(pilot, lambda: "Search" in keys() and "Stopped too" in keys(), what="the Engines keys")
        full = keys()
        await pilot.resize_terminal(60, 20)
        await until(pilot, lambda: keys() != full, what="the keys at 60 columns")
        shown = keys()
        assert len(shown) <= app.query_one("#keys").size.width
        assert "Searc" not in shown and shown.endswith("? Help  q Quit") and full.endswith("? Help  q Quit")
        head = shown.removesuffix("? Help  q Quit").rstrip()
        assert head and full.startswith(head) and full[len(head):].startswith("  ")  # whole keys, in order
        await pilot.resize_terminal(120, 40)
        await until(pilot, lambda: keys() == full, what="all the keys again")


def test_engine_form_refuses_cuda_only_where_the_machine_surely_has_no_gpu():
    """An empty NVML reading refuses cuda only when it says there is no GPU (no driver, none
    counted). One NVML could not complete (permissions, a GPU it cannot open, which empties the
    list on a box whose other GPUs work) tells nothing of the GPUs CUDA sees: not refused."""
    from ddtree.engine.machine.hw import GpuView

    from ddtree.console.screens.engines import device_refusal

    for reason in ("NVML library not found (no NVIDIA driver installed)", "NVIDIA driver not loaded",
                   "NVML found no GPU", None):
        assert "has no GPU" in device_refusal("cuda", GpuView(reason=reason)), reason
    for reason in ("insufficient permissions", "GPU 3: GPU is lost", "cannot count GPUs: Unknown Error",
                   "nvidia-ml-py is not installed (pip install nvidia-ml-py)"):
        assert device_refusal("cuda", GpuView(reason=reason)) is None, reason
        assert device_refusal("cuda:5", GpuView(reason=reason)) is None, reason
    assert device_refusal("cpu", GpuView(reason="NVIDIA driver not loaded")) is None
    assert device_refusal("cuda", None) is None  # not read yet
