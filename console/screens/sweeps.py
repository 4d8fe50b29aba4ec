"""Sweeps: live budget curves (tau and output tok/s against the DDTree node budget, one line per
concurrency/TP, error bars over repeats, AR/DFlash baselines as dotted reference lines, the best
budget starred), or the acceptance heatmap in their place (h), above the budget to serve with
(store.insight), any regression against earlier runs of the same fingerprint (store.sentinel)
and the table of points; start a sweep from a form or a recipe file."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import median

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from ddtree.console import fmt
from ddtree.console.eta import sweep_progress
from ddtree.console.words import plural
from ddtree.console.palette import bindings
from ddtree.console.widgets.chart import COLORS, LineChart, Series
from ddtree.console.widgets.heatmap import heatmap_text
from ddtree.console.screens.modals import FOCUS_KEYS
from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.widgets.tables import fmt_num, sync_table
from ddtree.store.contention import run_busy_note
from ddtree.store.stats import UNSTABLE_CV
from ddtree.store.insight import labelled_recommendations
from ddtree.store.summary import series_verdict

# TAUw: tau weighted by verify count (README, Metrics: tau_weighted), the mean where an engine
# reports no verify counts; tau_of picks it.
POINT_COLUMNS = ("#", "ALGO", "BUDGET", "C", "TP", "STATE", "TOK/S", "TAUw", "xAR", "xDFLASH", "E2E p50", "NOTE")
BASELINE_COLORS = {"ar": "grey58", "dflash": "gold3"}
BASELINE_NAMES = {"ar": "AR", "dflash": "DFlash"}


def tau_of(p) -> float | None:
    return p.tau_weighted if p.tau_weighted is not None else p.tau_mean


def _series_key(p) -> tuple:
    return (p.concurrency, p.tp, p.dataset, p.temperature)


def _label(key: tuple, varying: set[int]) -> str:
    names = ("c=", "tp=", "", "T=")
    parts = [f"{names[i]}{key[i]:g}" if isinstance(key[i], float) else f"{names[i]}{key[i]}"
             for i in sorted(varying)]
    return " ".join(parts) or f"c={key[0]}"


def budget_curves(points: list, *, prefix: str = "", colors: tuple[str, ...] = COLORS,
                  baselines: bool = True, unstable_cv: float = UNSTABLE_CV) -> tuple[list[Series], list[Series], list[str]]:
    """(tau series, tok/s series, best-budget lines) from a run's points (done ones count)."""
    done = [p for p in points if p.state == "done" and p.output_tok_s is not None]
    measured = [p for p in done if p.algorithm == "ddtree" and p.budget is not None]
    keys = sorted({_series_key(p) for p in done}, key=lambda k: tuple(str(v) for v in k))
    varying = {i for i in range(4) if len({k[i] for k in keys}) > 1} or {0}
    tau_out, tok_out, best_lines = [], [], []
    for n, key in enumerate(sorted({_series_key(p) for p in measured}, key=lambda k: tuple(str(v) for v in k))):
        color = colors[n % len(colors)]
        label = prefix + _label(key, varying)
        cells: dict[int, list] = defaultdict(list)
        for p in measured:
            if _series_key(p) == key:
                cells[p.budget].append(p)
        taus, toks, tau_err, tok_err = [], [], [], []
        for budget in sorted(cells):
            group = cells[budget]
            t_values = [tau_of(p) for p in group if tau_of(p) is not None]
            k_values = [p.output_tok_s for p in group]
            if t_values:
                taus.append((float(budget), median(t_values)))
                if len(t_values) > 1:
                    tau_err.append((float(budget), min(t_values), max(t_values)))
            toks.append((float(budget), median(k_values)))
            if len(k_values) > 1:
                tok_err.append((float(budget), min(k_values), max(k_values)))
        # The verdict comes from the store's one definition of "best" (runs and exports read it too).
        verdict = series_verdict([p for p in done if _series_key(p) == key], unstable_cv=unstable_cv)
        leader = verdict.verdict.best
        best = next(((x, y) for x, y in toks if x == leader), None) if leader is not None else None
        tau_out.append(Series(label, tuple(taus), color, tuple(tau_err)))
        tok_out.append(Series(label, tuple(toks), color, tuple(tok_err), best=best))
        if verdict.verdict.state != "none":
            best_lines.append(f"{label}: {verdict.line}")
    if baselines:
        shown = sorted({_series_key(p) for p in measured}, key=lambda k: tuple(str(v) for v in k))
        shown = shown[:2] if len(shown) <= 2 else shown[:1]
        for alg in ("ar", "dflash"):
            for key in shown or keys[:1]:
                ref = [p for p in done if p.algorithm == alg and _series_key(p) == key]
                if not ref:
                    continue
                label = prefix + BASELINE_NAMES[alg] + ("" if len(shown) <= 1 else " " + _label(key, varying))
                tok_out.append(Series(label, ((0.0, median(p.output_tok_s for p in ref)),),
                                      BASELINE_COLORS[alg], reference=True))
                taus = [tau_of(p) for p in ref if tau_of(p) is not None]
                if taus and alg != "ar":
                    tau_out.append(Series(label, ((0.0, median(taus)),), BASELINE_COLORS[alg], reference=True))
    return tau_out, tok_out, best_lines


#: What the charts say while a run has no DDTree point to draw.
WAITING = "waiting for the first point…"
#: A point's state once its run has ended without it: nothing measures it any more.
ENDED_STATES = {"pending": "not run", "running": "stopped"}


def run_ended(run) -> bool:
    return run is not None and run.state not in ("running", "queued")


def chart_empty_text(run) -> str:
    """What the empty charts say: waiting while the run goes on; once it ended (cancelled, failed,
    lost) without a DDTree point, that it ended, and how far it got; a run that finished its plan
    (one of dflash or ar only) has none to draw, and was not cut short."""
    if not run_ended(run):
        return WAITING
    done, total = run.points_done or 0, run.points_total or 0
    if run.state == "succeeded":
        return "no DDTree point in this run" + (f"\n({done}/{total} points done, below)" if done else "")
    if not done:
        return f"run {run.state} before its first point"
    return f"run {run.state} before a DDTree point\n({done}/{total} points done, below)"


def point_cells(p, ended: bool = False) -> tuple:
    """A row of the points table; `ended`: the run is over, so a point still pending (or left
    running by a runner that went away) will not be measured, and says so."""
    state_style = {"done": "green", "failed": "red", "running": "yellow", "skipped": "dim", "pending": "dim"}
    state = p.state or "-"
    if ended and state in ENDED_STATES:
        state, state_style = ENDED_STATES[state], {ENDED_STATES[state]: "dim"}
    busy = "busy box" if getattr(p, "contended", None) else ""
    note = p.error or ("unstable repeats" if p.unstable else "") or busy or ("baseline" if p.baseline else "")
    return (str(p.idx + 1) if p.idx is not None else str(p.id), p.algorithm or "-",
            "-" if p.budget is None else str(p.budget), str(p.concurrency or "-"), str(p.tp or "-"),
            Text(state, style=state_style.get(state, "")), fmt_num(p.output_tok_s, ".1f"),
            fmt_num(tau_of(p)), fmt_num(p.speedup_vs_ar), fmt_num(p.speedup_vs_dflash), fmt_num(p.e2e_p50, ".2f"),
            Text((note or "")[:60], style="red" if p.error else "dim"))


def insight_text(rows: list, *, prefix: str = "") -> Text:
    """The lines under the charts: the budget to serve with per setting (store.insight), then
    failures. Empty when there is nothing to say."""
    lines = [(f"{prefix}{label}: {rec.line}", "bold") for label, rec in labelled_recommendations(rows)]
    failed = [p for p in rows if p.state == "failed"]
    if failed:
        lines.append((f"{plural(len(failed), 'point')} failed: {failed[-1].error or '?'}"[:200], "red"))
    text = Text()
    for n, (line, style) in enumerate(lines):
        text.append(("\n" if n else "") + line, style=style)
    return text


def point_in_progress(rows: list) -> int | None:
    """The index of the point being measured (else the next to run) among `rows`: the row the
    table keeps on screen; None when every point has finished."""
    for state in ("running", "pending"):
        found = next((i for i, p in enumerate(rows) if p.state == state), None)
        if found is not None:
            return found
    return None


def sentinel_text(report) -> Text | None:
    """The regression flags of a run against its history (store.sentinel), or None for none."""
    if report is None or not report.flagged:
        return None
    return Text("\n".join("⚠ " + line for line in report.lines), style="bold red")


class SweepsPane(Vertical):
    ALLOW_MAXIMIZE = True

    DEFAULT_CSS = """
    SweepsPane #heatmap {
        height: 1fr;
        min-height: 8;
        display: none;
        padding: 0 1;
    }
    SweepsPane .pane-bar Button {
        width: auto;
        min-width: 0;
    }
    SweepsPane #sentinel {
        height: auto;
        max-height: 3;
        display: none;
        padding: 0 1;
    }
    """

    _busy: tuple[int | None, str | None] = (None, None)
    """(run id, busy-box note) of the points shown last."""
    _rows: list = []
    """The points shown last (the heatmap and the sentinel redraw from them)."""
    _run_id: int | None = None
    _history: dict = {}
    """run id -> (run, [(earlier run, its points)]) for the sentinel, read once per run by a worker."""
    _ended: bool = False
    """Whether the points table was drawn for a run that has ended (its pending points: not run)."""
    _in_view: tuple[int | None, str | None] = (None, None)
    """(run id, point id) last scrolled into view: the table follows the point in progress when it
    moves on, and leaves the user's scrolling alone in between."""

    TICK_S = 1.0
    """How often the header's ETA is redrawn: it counts down while a point runs."""
    WIDE = 100
    """From this width on the header also spells out the [ ] keys (the key bar has them too)."""

    BINDINGS = [*bindings("sweeps"), Binding("escape", "close_heatmap", "Curves", show=False)]

    def compose(self) -> ComposeResult:
        with Horizontal(classes="pane-bar"):
            yield Static("Sweeps", id="sweep-title", classes="pane-title grow")
            yield Button("New (n)", id="new-sweep", compact=True)
            yield Button("Stop (x)", id="stop-sweep", compact=True, variant="error")
        with Horizontal(id="charts"):
            yield LineChart("tau, weighted by verify count", x_label="budget", id="tau-chart", empty=WAITING)
            yield LineChart("output tok/s", x_label="budget", id="toks-chart", empty=WAITING)
        with VerticalScroll(id="heatmap"):
            yield Static("", id="heatmap-body")
        yield Static("", id="sentinel")
        yield Static("", id="best")
        yield RowTable(*POINT_COLUMNS, id="points")

    def on_mount(self) -> None:
        self._history = {}
        self.watch(self.app, "points", self.show)
        self.watch(self.app, "snapshot", self.show_title)
        self.set_interval(self.TICK_S, self.tick)

    def tick(self) -> None:
        run = self.app.shown_run()
        if run is not None and run.state in ("running", "queued"):
            self.show_title(None)

    def progress_text(self, run) -> str:
        """`9/14 points, ETA 2m05s` while the run goes on (eta.sweep_progress, from its measured
        point times), `14/14 points` once it ended."""
        total = run.points_total or 0
        if run.state in ("running", "queued") and self._run_id == run.id:
            return sweep_progress(self._rows, self.app.clock(), total).text
        return f"{run.points_done}/{total} points"

    def show_title(self, _snapshot) -> None:
        run = self.app.shown_run()
        title = self.query_one("#sweep-title", Static)
        self.show_ended(run)
        if run is None:
            title.update("Sweeps: no run yet. Press n to start one (the demo pair by default).")
            return
        text = Text(f"Run {run.id} {run.name or ''} ({run.state or '-'}) {self.progress_text(run)}"
                    + (f", {run.points_failed} failed" if run.points_failed else ""))
        if (self.size.width or self.app.size.width) >= self.WIDE:
            # A key hint, spelled out: a bare "[ ]" read as a checkbox that could not be ticked.
            text.append("   keys ", style="dim")
            text.append("[", style="bold")
            text.append(" ", style="dim")
            text.append("]", style="bold")
            text.append(": older/newer run", style="dim")
        busy_run, busy = self._busy
        if busy and busy_run == run.id:
            text.append(f"   {busy}", style="bold yellow")
        title.update(text)

    def show(self, points) -> None:
        run_id, rows = points if points is not None else (None, [])
        self._run_id, self._rows = run_id, rows
        # What competed with the points (store/contention.py): a short note in the header.
        self._busy = (run_id, run_busy_note(rows))
        tau, toks, _best = budget_curves(rows)
        self.query_one("#tau-chart", LineChart).set_series(tau)
        self.query_one("#toks-chart", LineChart).set_series(toks)
        self.show_insight()
        if self.heatmap_shown:
            self.show_heatmap()
        self.show_title(None)
        self.sync_points()
        self.follow_progress(run_id, rows)
        if run_id is not None and run_id not in self._history:
            self._history[run_id] = None  # asked once; the worker fills it in
            self._load_history(run_id)

    def show_ended(self, run) -> None:
        """The charts' note and the table's states follow the run's end: the store's snapshot
        (the run's state) and its points arrive apart, so either may be the one that tells."""
        shown = run if run is not None and run.id == self._run_id else None
        for chart in self.query(LineChart):
            chart.set_empty(chart_empty_text(shown))
        if run_ended(shown) != self._ended:
            self.sync_points()

    def sync_points(self) -> None:
        run = self.app.shown_run()
        self._ended = run_ended(run if run is not None and run.id == self._run_id else None)
        sync_table(self.query_one("#points", RowTable),
                   [(str(p.id), point_cells(p, self._ended)) for p in self._rows])

    def follow_progress(self, run_id: int | None, rows: list) -> None:
        """Keep the point in progress on screen: at 80x24 the table shows seven rows, and point 10
        of 14 would sit below them. Only when that point changes, so a user's scrolling stays."""
        index = point_in_progress(rows)
        key = str(rows[index].id) if index is not None else None
        if (run_id, key) == self._in_view:
            return
        self._in_view = (run_id, key)
        if index is not None:
            # Two finished points above it for context, what is to come below. Made now, before the
            # layout of the rows just set: the table finishes a scroll that layout cut short.
            self.query_one("#points", RowTable).scroll_row_to_top(max(0, index - 2))

    def sentinel_report(self):
        """The run's points against earlier runs of its fingerprint, once their history is read."""
        from ddtree.store.sentinel import sentinel

        known = self._history.get(self._run_id)
        if known is None or not self._rows:
            return None
        run, history = known
        return sentinel(run, self._rows, history)

    def show_insight(self) -> None:
        self.query_one("#best", Static).update(insight_text(self._rows))
        flags = sentinel_text(self.sentinel_report())
        box = self.query_one("#sentinel", Static)
        box.display = flags is not None
        box.update(flags or "")

    @work(thread=True, group="sweep-history", exit_on_error=False)
    def _load_history(self, run_id: int) -> None:
        from ddtree.store.errors import StoreError
        from ddtree.store.sentinel import history_for
        from ddtree.store.sweeps import get_run

        try:
            with self.app.reading() as db:
                run = get_run(db, run_id)
                history = history_for(db, run)
        except StoreError:
            return  # the sentinel stays silent; the pane itself still works
        self.app.call_from_thread(self._history_read, run_id, run, history)

    def _history_read(self, run_id: int, run, history: list) -> None:
        if len(self._history) > 16:  # a long session of paging through runs: keep the newest asks
            for old in list(self._history)[:-16]:
                del self._history[old]
        self._history[run_id] = (run, history)
        if run_id == self._run_id:
            self.show_insight()

    @property
    def heatmap_shown(self) -> bool:
        return bool(self.query_one("#heatmap").display)

    def show_heatmap(self) -> None:
        width = max(40, self.size.width - 4)
        self.query_one("#heatmap-body", Static).update(heatmap_text(self._rows, width))

    def action_toggle_heatmap(self) -> None:
        """h: the acceptance heatmap in place of the charts, and back."""
        shown = not self.heatmap_shown
        self.query_one("#heatmap").display = shown
        self.query_one("#charts").display = not shown
        if shown:
            self.show_heatmap()

    def action_close_heatmap(self) -> None:
        """Escape: back to the curves from the heatmap, as Escape leaves every other view."""
        self.action_toggle_heatmap()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # Escape is the heatmap's only while it shows: otherwise it goes on to whoever else binds it.
        return self.heatmap_shown if action == "close_heatmap" else True

    def on_resize(self, _event) -> None:
        if self.heatmap_shown:
            self.show_heatmap()

    @on(Button.Pressed, "#new-sweep")
    async def _new(self) -> None:
        await self.app.run_action("new_sweep")

    @on(Button.Pressed, "#stop-sweep")
    async def _stop(self) -> None:
        await self.app.run_action("stop_sweep")


def _ints(text: str) -> list[int]:
    out = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if part:
            out.append(int(part))
    return out


class SweepForm(ModalScreen[dict | None]):
    """A sweep from a few fields or a recipe file; the dry-run plan is shown before anything starts."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="form_cancel"), *FOCUS_KEYS]

    FIELDS = (
        ("recipe", "Recipe file", "a .toml recipe; when given, the fields below are ignored", ""),
        ("name", "Name", "a name for the run", "demo-budgets"),
        ("model", "Model", "folder or hub id; empty: the demo pair", ""),
        ("draft", "Drafter", "DFlash drafter folder or hub id", ""),
        ("kind", "Engine", "builtin, sglang or vllm", "builtin"),
        ("python", "Python", "sglang/vllm: the interpreter that has it; empty: this one", ""),
        ("backend", "Backend", "builtin: auto, fast or transformers", "auto"),
        ("gpus", "GPUs", "sglang/vllm: GPU indices, e.g. 0, 1; empty: placed on this box", ""),
        ("tp", "TP", "tensor-parallel sizes, e.g. 1, 2", "1"),
        ("budgets", "Budgets", "DDTree node budgets, e.g. 4, 8, 16", "4, 16"),
        ("concurrency", "Concurrency", "e.g. 1, 2", "1"),
        ("temperature", "Temperature", "e.g. 0 or 0, 0.7", "0"),
        ("dataset", "Dataset", "builtin:code or a .jsonl file", "builtin:code"),
        ("prompts", "Prompts", "prompts per point", "8"),
        ("tokens", "Max tokens", "new tokens per request", "48"),
        ("baseline", "Baselines", "ar, dflash (or empty)", "ar, dflash"),
        ("repeats", "Repeats", "measured passes per point (medians and spread over them)", "1"),
        ("warmup", "Warm-up", "unmeasured requests before each point", "1"),
        ("interleave", "Interleave", "yes: repeats cycle over the grid (A B A B); no: back to back", "yes"),
        ("device", "Device", "cpu or cuda", "cpu"),
    )

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog form wide"):
            yield Static("Start a sweep", classes="dialog-title")
            with VerticalScroll(id="sweep-fields"):
                # what was typed when a sweep was last started from this console (the app keeps it)
                last = getattr(self.app, "sweep_form_values", {})
                for field_id, label, placeholder, value in self.FIELDS:
                    with Horizontal(classes="form-row"):
                        yield Label(label)
                        yield Input(last.get(field_id, value), placeholder=placeholder,
                                    id=f"f-{field_id}", compact=True)
                yield Static("", id="plan", classes="plan")
            with Horizontal(classes="buttons"):
                yield Button("Start", id="start", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#f-recipe", Input).focus()
        self.check()

    def value(self, field_id: str) -> str:
        return self.query_one(f"#f-{field_id}", Input).value.strip()

    def recipe_data(self) -> tuple[dict, str | None]:
        """The recipe as a dict and the file it came from (None for the form)."""
        from ddtree.jobs.recipe import load_recipe, recipe_to_dict

        path = self.value("recipe")
        if path:
            return recipe_to_dict(load_recipe(Path(path).expanduser())), str(Path(path).expanduser().resolve())
        kind = self.value("kind") or "builtin"
        engine: dict = {"kind": kind}
        if kind == "builtin":
            engine["device"] = self.value("device") or "cpu"
            engine["backend"] = self.value("backend") or "auto"
        if self.value("python"):
            engine["python"] = self.value("python")
        try:
            gpus = _ints(self.value("gpus"))
        except ValueError:
            raise _FormError("gpus: GPU indices separated by commas") from None
        if gpus:
            engine["gpus"] = gpus
        if self.value("model"):
            engine["model"] = self.value("model")
        if self.value("draft"):
            engine["draft_model"] = self.value("draft")
        sweep: dict = {"dataset": self.value("dataset") or "builtin:code", "warmup": 1}
        interleave = self.value("interleave").lower()
        if interleave:
            if interleave not in ("yes", "no", "true", "false"):
                raise _FormError("interleave: yes or no")
            sweep["interleave"] = interleave in ("yes", "true")
        try:
            temperature = [float(t) for t in self.value("temperature").replace(";", ",").split(",") if t.strip()]
        except ValueError:
            raise _FormError("temperature: numbers separated by commas") from None
        if temperature:
            sweep["temperature"] = temperature
        for key, field_id in (("budget", "budgets"), ("concurrency", "concurrency"), ("tp", "tp")):
            try:
                values = _ints(self.value(field_id))
            except ValueError:
                raise _FormError(f"{key}: whole numbers separated by commas") from None
            if values:
                sweep[key] = values
        for key, field_id in (("num_prompts", "prompts"), ("max_new_tokens", "tokens"), ("repeats", "repeats"),
                              ("warmup", "warmup")):
            text = self.value(field_id)
            if text:
                try:
                    sweep[key] = int(text)
                except ValueError:
                    raise _FormError(f"{key}: a whole number") from None
        baseline = [b.strip() for b in self.value("baseline").split(",") if b.strip()]
        if baseline:
            sweep["baseline"] = baseline
        return {"name": self.value("name") or "sweep", "engine": engine, "sweep": sweep}, None

    _checked: tuple[int, dict | None] = (-1, None)  # (generation, spec) of the newest finished check
    _message = ""  # what that check said
    _generation = 0
    _start_when_checked = False
    _pending: tuple | None = None  # the newest input not yet planned
    _planning = False

    def check(self) -> None:
        """Validate as typed: the fields or recipe file here, the plan in a thread. A plan can probe
        an SGLang interpreter's --help (seconds, once per interpreter), which must not freeze
        typing. One plan runs at a time; input typed meanwhile is planned next, newest only."""
        from ddtree.jobs.errors import JobError

        self._generation += 1
        self.query_one("#start", Button).disabled = True
        try:
            data, path = self.recipe_data()
        except (JobError, _FormError) as exc:
            self._pending = None
            self._show(self._generation, None, f"not valid: {exc}")
            return
        self._pending = (self._generation, data, path)
        if not self._planning:
            self._plan_next()

    def _plan_next(self) -> None:
        job, self._pending = self._pending, None
        self._planning = job is not None
        if job is not None:
            self.run_worker(lambda: self._plan(*job), thread=True, group="plan", exit_on_error=False)

    def _plan(self, generation: int, data: dict, path: str | None) -> None:
        from ddtree.engine.errors import EngineError
        from ddtree.jobs.errors import JobError
        from ddtree.jobs.plan import format_plan
        from ddtree.jobs.recipe import recipe_from_dict
        from ddtree.jobs.start import plan_sweep
        from ddtree.store.db import data_dir

        try:
            # The checks `sweep` makes before it starts anything (start_sweep runs them again), so the
            # form refuses what the command line refuses, before Start is pressed.
            plan = plan_sweep(recipe_from_dict(data), cache_dir=data_dir(self.app.db_path)).plan
        except (JobError, EngineError) as exc:
            result = (None, f"not valid: {exc}")
        except Exception as exc:  # noqa: BLE001 - a probe that broke must not leave the form waiting
            result = (None, f"could not plan: {type(exc).__name__}: {exc}")
        else:
            spec = {"recipe": data, "recipe_path": path, "points_total": len(plan.points)}
            result = (spec, "Plan (dry run):\n" + format_plan(plan))
        try:
            self.app.call_from_thread(self._planned, generation, *result)
        except RuntimeError:  # the app closed while the plan was being made
            pass

    def _planned(self, generation: int, spec: dict | None, message: str) -> None:
        if not self.is_attached:
            return
        self._show(generation, spec, message)
        self._plan_next()

    def _show(self, generation: int, spec: dict | None, message: str) -> None:
        if generation != self._generation:
            return  # newer input overtook this plan
        self._checked = (generation, spec)
        self._message = message
        self.query_one("#plan", Static).update(Text(message, style="" if spec else "red"))
        self.query_one("#start", Button).disabled = spec is None
        if self._start_when_checked:
            self._start_when_checked = False
            self._start()

    def on_input_changed(self, event) -> None:
        if event.input.id == "f-recipe":
            # a recipe file decides everything: the fields it overrides are greyed out
            given = bool(event.value.strip())
            for field_id, *_ in self.FIELDS[1:]:
                self.query_one(f"#f-{field_id}", Input).disabled = given
        self.check()

    def on_input_submitted(self, _event) -> None:
        self._start()

    @on(Button.Pressed, "#start")
    def _start(self) -> None:
        generation, spec = self._checked
        if generation != self._generation:
            self._start_when_checked = True  # Enter typed before the plan came back
        elif spec is not None:
            self.app.sweep_form_values = {field_id: self.value(field_id) for field_id, *_ in self.FIELDS}
            self.dismiss(spec)
        else:
            # Why it cannot start sits under the fields, below the fold on a small terminal: bring
            # it into view and say it, so Enter never looks like it did nothing.
            self.query_one("#plan", Static).scroll_visible()
            self.notify(fmt.one_line(self._message, 200), title="cannot start", severity="error")

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class _FormError(Exception):
    pass
