"""History: every run, filtered and sorted in SQL (a page at a time, so 10,000 runs stay fast);
select two or more to compare (differing settings highlighted, metric deltas, overlaid curves,
a warning when the hardware differs); export a run as csv, json, md or a recipe. FLAGS is the
regression sentinel (store.sentinel): a run's figures against earlier runs of its fingerprint,
read for the rows shown on a worker and kept until the run's points change."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static
from textual.worker import get_current_worker

from ddtree.console import fmt
from ddtree.console.words import plural
from ddtree.console.poll import HISTORY_PAGE
from ddtree.console.screens.sweeps import budget_curves, tau_of
from ddtree.console.widgets.chart import COLORS, LineChart
from ddtree.console.screens.modals import FOCUS_KEYS
from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.widgets.searchinput import SearchInput
from ddtree.console.widgets.tables import fmt_num
from ddtree.engine.serving.names import run_drafter_name, run_model_name

COLUMNS = ("ID", "NAME", "ENGINE", "MODEL", "STATE", "POINTS", "BEST TOK/S", "CREATED", "FLAGS")
#: Below WIDE columns the table drops ENGINE (the filter, the run's screen and compare still have
#: it), shortens two headers and stamps 'MM-DD HH:MM', so that CREATED fits 80 columns.
NARROW_COLUMNS = ("ID", "NAME", "MODEL", "STATE", "PTS", "BEST", "CREATED", "FLAGS")
WIDE = 100
#: Rows shown at once; the filter narrows the rest (the poller reads the default page: same size).
PAGE = HISTORY_PAGE
SORTS = ("newest", "oldest", "name", "model", "best tok/s")  # store.queries.RUN_ORDERS


def load_runs(db, text: str = "", sort: int = 0, limit: int = PAGE) -> tuple[list[dict], int]:
    """One page of runs matching `text` (case-insensitive, in name, models, engine, state or
    recipe), sorted by SORTS[sort]; and how many match in all."""
    from ddtree.engine.serving.names import names_demo_pair
    from ddtree.store.queries import runs_page

    return runs_page(db, text, order=SORTS[sort % len(SORTS)], limit=limit, unnamed_model=names_demo_pair(text))


def flag_cell(short: str | None) -> Text:
    """The FLAGS cell from a SentinelReport's `short`: red when a figure fell, dim when checked."""
    short = short or ""
    return Text(fmt.one_line(short, 48), style="bold red" if short.startswith("⚠") else "dim")


def run_model(row: dict) -> str:
    """The run's model as a user names it: a run with no model ran the demo pair (demo/target)."""
    return run_model_name(row.get("model"))


def short_stamp(at: float | None) -> str:
    """'09-21 14:03': the year is the one thing a narrow table leaves out."""
    return "-" if at is None else time.strftime("%m-%d %H:%M", time.localtime(at))


def run_cells(row: dict, marked: bool, flags: str | None = None, *, narrow: bool = False) -> tuple:
    """One History row; `narrow` for NARROW_COLUMNS (names cut shorter, the compact stamp)."""
    points = fmt.points(row.get("points_done"), row.get("points_total"))
    ident = Text(f"✓{row['id']}", style="bold reverse") if marked else str(row["id"])
    name = fmt.one_line(row.get("name"), 14 if narrow else 24) or "-"
    model = fmt.one_line(run_model(row), 18 if narrow else 28)
    best = fmt_num(row.get("best"), ".1f")
    if narrow:
        return (ident, name, model, row.get("state") or "-", points, best, short_stamp(row.get("created_at")),
                flag_cell(flags))
    return (ident, name, row.get("engine_kind") or "-", model, row.get("state") or "-", points, best,
            fmt.stamp(row.get("created_at")), flag_cell(flags))


def _flag_key(row: dict) -> tuple:
    """What a run's sentinel depends on that a page row shows changing: its points and state."""
    return (row.get("points_done"), row.get("state"), row.get("best"))


#: The filter box's hints, longest first: it shows the longest that fits (60-72 columns cut the first).
FILTER_HINTS = ("/ filter: name, model, engine…", "/ filter runs", "/ filter", "/")


class HistoryPane(Vertical):
    ALLOW_MAXIMIZE = True

    DEFAULT_CSS = """
    HistoryPane .pane-bar Button {
        width: auto;
        min-width: 0;
    }
    """

    BINDINGS = [
        # Priority, so the keys typed right behind / reach the box (the app skips it while typing).
        Binding("slash", "app.history_filter", "Filter", id="history_filter", priority=True),
        Binding("space", "app.history_mark", "Select", id="history_mark"),
        Binding("c", "app.history_compare", "Compare", id="history_compare"),
        Binding("e", "app.history_export", "Export", id="history_export"),
        Binding("s", "app.history_sort", "Sort", id="history_sort"),
    ]

    def compose(self) -> ComposeResult:
        with Horizontal(classes="pane-bar"):
            yield Static("History", id="history-title", classes="pane-title grow")
            yield SearchInput(hints=FILTER_HINTS, id="history-filter", compact=True,
                              leave_to="runs")
            yield Button("Compare (c)", id="compare", compact=True)
            yield Button("Export (e)", id="export", compact=True)
        yield RowTable(*COLUMNS, id="runs")

    def on_mount(self) -> None:
        self.sort = 0
        self.marked: set[int] = set()
        self.rows: list[dict] = []
        self.total = 0
        self._asked = 0  # the newest request; older answers are dropped
        self.flags: dict[int, tuple[tuple, str]] = {}  # run id -> (its _flag_key, SentinelReport.short)
        self._flagging: set[int] = set()
        self._narrow: bool | None = None  # the column set shown; None before the first rows
        # The box takes the bar's room, the title only its text: app.tcss gives .pane-bar inputs 30
        # cells and titles the rest, which cut the hint. Inline, as app.tcss outranks DEFAULT_CSS.
        self.query_one("#history-filter", Input).styles.width = "1fr"
        self.query_one("#history-title", Static).styles.width = "auto"
        self.query_one("#history-title", Static).styles.margin = (0, 1, 0, 0)
        self.watch(self.app, "runs_signature", lambda _sig: self.reload())

    def reload(self) -> None:
        self._asked += 1
        text = self.query_one("#history-filter", Input).value
        page = self.app.runs_page
        if not text.strip() and self.sort == 0 and page is not None:
            self.show(*page)  # the default view: the poller read it with the change it reports
            return
        self._load(self._asked, text, self.sort)

    @work(thread=True, exclusive=True, group="history", exit_on_error=False)
    def _load(self, request: int, text: str, sort: int) -> None:
        with self.app.reading() as db:
            # Typing queues one request per key; only the newest is worth a scan.
            if request != self._asked or get_current_worker().is_cancelled:
                return
            rows, total = load_runs(db, text, sort)
        if request == self._asked:
            self.app.call_from_thread(self._answer, request, rows, total)

    def _answer(self, request: int, rows: list[dict], total: int) -> None:
        if request == self._asked:
            self.show(rows, total)

    def show(self, rows: list[dict], total: int) -> None:
        self.rows, self.total = rows, total
        self._render_rows()
        stale = {r["id"]: _flag_key(r) for r in rows
                 if r["id"] not in self._flagging and self.flags.get(r["id"], (None,))[0] != _flag_key(r)}
        if stale:
            self._flagging |= set(stale)
            self._check(stale)
        self._show_title()

    def _show_title(self) -> None:
        rows, total = self.rows, self.total
        shown = f"{len(rows)} of {total} runs" if total > len(rows) else plural(total, "run")
        sel = f", {len(self.marked)} selected" if self.marked else ""
        # the tab already says History; at 80 columns the filter box needs the room
        prefix = "" if self.narrow else "History: "
        self.query_one("#history-title", Static).update(Text(f"{prefix}{shown}, {SORTS[self.sort]} first{sel}"))

    @property
    def narrow(self) -> bool:
        # a pane not laid out yet (hidden behind another) has no width: the terminal's stands in
        return 0 < (self.size.width or self.app.size.width) < WIDE

    def _render_rows(self) -> None:
        table = self.query_one("#runs", RowTable)
        narrow = self.narrow
        if narrow != self._narrow:
            self._narrow = narrow
            table.set_columns(*(NARROW_COLUMNS if narrow else COLUMNS))
        table.set_rows([(str(r["id"]), run_cells(r, r["id"] in self.marked, self.flags.get(r["id"], (None, ""))[1],
                                                 narrow=narrow)) for r in self.rows])

    def on_resize(self, _event) -> None:
        if self._narrow is not None and self.narrow != self._narrow:
            self._render_rows()
            self._show_title()

    @work(thread=True, group="history-sentinel", exit_on_error=False)
    def _check(self, keys: dict[int, tuple]) -> None:
        from ddtree.store.errors import StoreError
        from ddtree.store.sentinel import check_runs

        try:
            with self.app.reading() as db:
                reports = check_runs(db, list(keys))
        except StoreError:
            reports = {}
        self.app.call_from_thread(self._checked, keys, {rid: r.short for rid, r in reports.items()})

    def _checked(self, keys: dict[int, tuple], shorts: dict[int, str]) -> None:
        self._flagging -= set(keys)
        changed = False
        for rid, key in keys.items():
            changed |= self.flags.get(rid, (None, ""))[1] != shorts.get(rid, "")
            self.flags[rid] = (key, shorts.get(rid, ""))
        if changed and self.is_attached:
            self._render_rows()

    @on(Input.Changed, "#history-filter")
    def _filter(self, _event) -> None:
        self.reload()

    @on(Input.Submitted, "#history-filter")
    def _filter_done(self, _event) -> None:
        self.screen.set_focus(self.query_one("#runs", RowTable))

    def focus_filter(self) -> None:
        # At once, not on the next turn of the queue as Widget.focus does: keys are already queued.
        self.screen.set_focus(self.query_one("#history-filter", Input))

    def cycle_sort(self) -> None:
        self.sort = (self.sort + 1) % len(SORTS)
        self.reload()

    def current(self) -> int | None:
        key = self.query_one("#runs", RowTable).cursor_key
        return int(key) if key is not None else None

    def toggle_mark(self) -> None:
        run_id = self.current()
        if run_id is None:
            return
        self.marked ^= {run_id}
        self.show(self.rows, self.total)
        table = self.query_one("#runs", RowTable)
        if table.cursor_row < table.row_count - 1:
            table.move_cursor(row=table.cursor_row + 1)

    @on(RowTable.RowSelected, "#runs")
    def _selected(self) -> None:
        # Enter opens the run; Space (the pane's binding) marks it for compare.
        run_id = self.current()
        if run_id is not None:
            self.app.open_run(run_id)

    @on(Button.Pressed, "#compare")
    async def _compare(self) -> None:
        await self.app.run_action("history_compare")

    @on(Button.Pressed, "#export")
    async def _export(self) -> None:
        await self.app.run_action("history_export")


# -- comparing runs ------------------------------------------------------------------------------

def recipe_settings(run) -> dict[str, Any]:
    recipe = run.recipe if isinstance(run.recipe, dict) else {}
    engine, sweep = recipe.get("engine") or {}, recipe.get("sweep") or {}
    return {
        "engine": run.engine_kind or engine.get("kind", "builtin"),
        "model": run_model_name(run.model or engine.get("model")),
        "drafter": run_drafter_name(run.draft_model or engine.get("draft_model"), run.model or engine.get("model")),
        "device": engine.get("device", "cpu"),
        "block size": engine.get("block_size", "default"),
        "budgets": sweep.get("budget", engine.get("budget", "-")),
        "concurrency": sweep.get("concurrency", 1),
        "tp": sweep.get("tp", 1),
        "dataset": sweep.get("dataset", "builtin:code"),
        "prompts": sweep.get("num_prompts", 16),
        "max tokens": sweep.get("max_new_tokens", 128),
        "temperature": sweep.get("temperature", 0.0),
        "baselines": sweep.get("baseline", []),
    }


def hardware_summary(hw: Any) -> str:
    if not isinstance(hw, dict):
        return "unknown"
    gpus = hw.get("gpus") or []
    names: dict[str, int] = {}
    for g in gpus:
        names[g.get("name") or "?"] = names.get(g.get("name") or "?", 0) + 1
    gpu_text = ", ".join(f"{n}x {name}" for name, n in names.items()) or "no GPU"
    host = hw.get("host") or {}
    return f"{gpu_text}; {host.get('cpu_model') or 'CPU'} x{host.get('cpus_logical') or '?'}"


def hardware_key(hw: Any) -> Any:
    """What must match for two runs' figures to be comparable (the host name need not)."""
    if not isinstance(hw, dict):
        return None
    host = hw.get("host") or {}
    return (json.dumps([{k: g.get(k) for k in ("name", "memory_total", "nvlinks", "pcie_gen_max", "pcie_width_max")}
                        for g in hw.get("gpus") or []], sort_keys=True),
            json.dumps(hw.get("links"), sort_keys=True), hw.get("driver_version"), host.get("cpu_model"),
            host.get("cpus_logical"), host.get("memory_total"))


def software_line(run) -> str:
    sw = run.software if isinstance(run.software, dict) else {}
    pk = sw.get("packages") or {}
    return " ".join(f"{k}={pk[k]}" for k in ("torch", "transformers", "sglang", "vllm") if k in pk) or "-"


def _best(points: list) -> dict:
    done = [p for p in points if p.state == "done" and p.output_tok_s is not None and p.algorithm == "ddtree"]
    if not done:
        done = [p for p in points if p.state == "done" and p.output_tok_s is not None]
    if not done:
        return {}
    p = max(done, key=lambda q: q.output_tok_s)
    return {"best tok/s": p.output_tok_s, "best budget": p.budget, "tau at best": tau_of(p),
            "x AR at best": p.speedup_vs_ar, "x DFlash at best": p.speedup_vs_dflash, "E2E p50 at best": p.e2e_p50}


def _wrapped(value: Any, width: int) -> list[str]:
    """A settings cell as lines of at most `width` characters: wrapped, never cut (a software line
    of four versions, a long model name), and safe to print."""
    text = fmt.one_line(", ".join(map(str, value)) if isinstance(value, list) else str(value), None)
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def compare_tables(runs: list, points: dict[int, list]) -> tuple[Text, Text, str | None]:
    """(settings table, metrics with deltas against the first run, hardware warning or None)."""
    settings = {run.id: recipe_settings(run) for run in runs}
    for run in runs:
        settings[run.id]["hardware"] = hardware_summary(run.hardware)
        settings[run.id]["software"] = software_line(run)
    width = max(14, min(30, (100 - 16) // max(1, len(runs))))
    head = "".join(f"{'run ' + str(r.id):<{width}}" for r in runs)
    out = Text()
    out.append(f"{'setting':<17}{head}\n", style="bold")
    for key in settings[runs[0].id]:
        values = [settings[r.id].get(key) for r in runs]
        differ = len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1
        cells = [_wrapped(v, width - 1) for v in values]
        for line in range(max(map(len, cells))):
            out.append(f"{key if line == 0 else '':<17}", style="bold yellow" if differ else "dim")
            for cell in cells:
                text = cell[line] if line < len(cell) else ""
                out.append(f"{text:<{width - 1}}", style="reverse yellow" if differ and text else "")
                out.append(" ")
            out.append("\n")
    metrics = {run.id: _best(points.get(run.id, [])) for run in runs}
    for run in runs:
        # the count History shows for the run (the store's), not one of the points read here
        metrics[run.id]["points done"] = fmt.points(run.points_done, run.points_total)
    table = Text()
    table.append(f"{'metric':<17}{head}\n", style="bold")
    first = metrics[runs[0].id]
    for key in ("best tok/s", "best budget", "tau at best", "x AR at best", "x DFlash at best", "E2E p50 at best",
                "points done"):
        table.append(f"{key:<17}", style="bold")
        for n, run in enumerate(runs):
            value = metrics[run.id].get(key)
            cell = fmt_num(value) if isinstance(value, float) else ("-" if value is None else str(value))
            style = ""
            base = first.get(key)
            if n and isinstance(value, (int, float)) and isinstance(base, (int, float)) and base and key != "best budget":
                delta = (value - base) / abs(base) * 100
                lower_better = key.startswith("E2E")
                good = delta < 0 if lower_better else delta > 0
                cell += f" ({delta:+.0f}%)"
                style = "green" if good and abs(delta) >= 0.5 else ("red" if abs(delta) >= 0.5 else "")
            table.append(f"{cell:<{width}}", style=style)
        table.append("\n")
    table.append(delta_table(runs, points))
    keys = {json.dumps(hardware_key(r.hardware), default=str) for r in runs}
    warnings = []
    if len(keys) > 1:
        warnings.append("hardware differs between these runs (" + " | ".join(
            f"run {r.id}: {hardware_summary(r.hardware)}" for r in runs) + ")")
    if len({settings[r.id]["software"] for r in runs}) > 1:
        warnings.append("software versions differ (" + " | ".join(
            f"run {r.id}: {settings[r.id]['software']}" for r in runs) + ")")
    warning = "; ".join(warnings) + ": compare with care" if warnings else None
    return out, table, warning


def delta_table(runs: list, points: dict[int, list]) -> Text:
    """Per grid cell, each later run against the first: both medians with their 95% intervals,
    the change, and whether it is significant (store.summary.compare_cells decides)."""
    from ddtree.store.summary import compare_cells

    out = Text()
    base = runs[0]

    def cell(s: dict) -> str:
        if s["ci_low"] is None:
            return f"{fmt_num(s['median'])} (n={s['n']})"
        return f"{fmt_num(s['median'])} [{fmt_num(s['ci_low'])}-{fmt_num(s['ci_high'])}]"
    for run in runs[1:]:
        rows = compare_cells(points.get(base.id, []), points.get(run.id, []))
        out.append(f"\nper cell, run {run.id} against run {base.id} (output tok/s, median [95% CI])\n", style="bold")
        if not rows:
            out.append("  no grid cell in common\n", style="dim")
            continue
        out.append(f"  {'algorithm':<9}{'budget':>7}{'c':>4}  {'run ' + str(base.id):<24}{'run ' + str(run.id):<24}"
                   f"{'change':>8}  verdict\n", style="bold")
        for r in rows:
            budget = "-" if r["budget"] is None else str(r["budget"])
            change = "-" if r["delta_pct"] is None else f"{r['delta_pct']:+.1f}%"
            style = {"faster": "green", "slower": "red"}.get(r["verdict"], "dim")
            out.append(f"  {r['algorithm']:<9}{budget:>7}{r['concurrency']:>4}  {cell(r['base']):<24}"
                       f"{cell(r['other']):<24}{change:>8}  ")
            out.append(r["verdict"] + "\n", style=style)
    return out


class CompareScreen(ModalScreen[None]):
    """Two or more runs side by side."""

    # Opaque: behind a translucent backdrop Textual draws the whole screen below again, at every
    # refresh, for a dialog that covers it all anyway.
    DEFAULT_CSS = """
    CompareScreen {
        background: $background;
    }
    """

    BINDINGS = [Binding("escape,q", "close", "Close", id="compare_close")]

    def __init__(self, runs: list, points: dict[int, list]) -> None:
        super().__init__()
        self.runs, self.points = runs, points

    def compose(self) -> ComposeResult:
        settings, metrics, warning = compare_tables(self.runs, self.points)
        with VerticalScroll(classes="dialog full", id="compare"):
            yield Static(f"Compare runs {', '.join(str(r.id) for r in self.runs)}   (esc closes)",
                         classes="dialog-title")
            if warning:
                yield Static(Text("⚠ " + warning, style="bold red"), id="hw-warning")
            yield Static(settings, id="settings")
            yield Static(metrics, id="metrics")
            with Horizontal(id="compare-charts"):
                yield LineChart("tau", x_label="budget", id="cmp-tau")
                yield LineChart("output tok/s", x_label="budget", id="cmp-toks")

    def on_mount(self) -> None:
        tau, toks = [], []
        for n, run in enumerate(self.runs):
            color = COLORS[n % len(COLORS)]
            t, k, _ = budget_curves(self.points.get(run.id, []), prefix=f"r{run.id} ", colors=(color,) * 8,
                                    baselines=False)
            tau += t
            toks += k
        self.query_one("#cmp-tau", LineChart).set_series(tau)
        self.query_one("#cmp-toks", LineChart).set_series(toks)

    def action_close(self) -> None:
        self.dismiss(None)


# -- export --------------------------------------------------------------------------------------

FORMATS = (("csv", "csv"), ("json", "json"), ("markdown", "md"), ("recipe (TOML)", "recipe"))
EXTENSIONS = {"csv": "csv", "json": "json", "md": "md", "recipe": "toml"}


class ExportForm(ModalScreen[tuple[str, str] | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="form_cancel"), *FOCUS_KEYS]

    def __init__(self, run_id: int, folder: Path) -> None:
        super().__init__()
        self.run_id, self.folder = run_id, folder

    def default_path(self, fmt_name: str) -> str:
        return str(self.folder / f"run-{self.run_id}-{time.strftime('%Y%m%d')}.{EXTENSIONS[fmt_name]}")

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog form"):
            yield Static(f"Export run {self.run_id}", classes="dialog-title")
            with Horizontal(classes="form-row"):
                yield Label("Format")
                yield Select(FORMATS, value="md", allow_blank=False, id="format", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("File")
                yield Input(self.default_path("md"), id="path")
            yield Static("", id="form-error", classes="form-error")
            with Horizontal(classes="buttons"):
                yield Button("Export", id="start", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        # In the file path, so what is typed goes there and Enter exports at once; on the format
        # Select (the first field) Enter would only open its list, and on the button typing was lost.
        self.set_focus(self.query_one("#path", Input))

    def on_select_changed(self, event: Select.Changed) -> None:
        field = self.query_one("#path", Input)
        if Path(field.value).parent == self.folder:
            field.value = self.default_path(str(event.value))

    def _checked(self) -> tuple[str, str] | None:
        text = self.query_one("#path", Input).value.strip()
        error = self.query_one("#form-error", Static)
        path = Path(text).expanduser() if text else None
        if path is None or path.is_dir():
            error.update(Text("give a file path", style="red"))
            return None
        error.update("")
        return str(self.query_one("#format", Select).value), str(path)

    def on_input_changed(self, _event) -> None:
        self.query_one("#start", Button).disabled = self._checked() is None

    def on_input_submitted(self, _event) -> None:
        self._start()

    @on(Button.Pressed, "#start")
    def _start(self) -> None:
        result = self._checked()
        if result is not None:
            self.dismiss(result)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
