"""Engines: running servers (kind, backend, model, algorithm, budget, GPUs, port, health, uptime),
their log (follow, search, wrap), and a form to start one; stopping asks first."""

from __future__ import annotations

import json
from weakref import WeakKeyDictionary

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from ddtree.console import fmt
from ddtree.console.palette import bindings
from ddtree.console.widgets.logview import LogView
from ddtree.console.screens.modals import FOCUS_KEYS
from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.widgets.searchinput import SearchInput
from ddtree.console.widgets.tables import sync_table

# What tells engines apart and whether they serve comes first, so 80 columns keep it on screen.
COLUMNS = ("JOB", "MODEL", "ALGO", "BUDGET", "STATE", "HEALTH", "UPTIME", "PORT", "GPUS", "KIND", "BACKEND")


#: Engines that are up or coming up; the rest (stopped, failed) sit behind the `a` filter.
LIVE_STATES = ("running", "starting")


def short_model(name: str | None) -> str:
    """The model as a user knows it: the name given or the repo id (names.display_name)."""
    from ddtree.engine.serving.names import display_name

    return display_name(name)


def engine_order(rows: list[dict], show_stopped: bool = False, keep: str | None = None) -> list[dict]:
    """Running engines first, then starting ones, then (if asked for) the stopped and failed;
    newest first within each. `keep` (a row id) stays listed whatever its state: an engine that
    stops while the cursor is on it does not vanish from under it."""
    order = {"running": 0, "starting": 1}
    kept = [r for r in rows if show_stopped or r.get("state") in LIVE_STATES or str(r.get("id")) == keep]
    return sorted(kept, key=lambda r: (order.get(r.get("state"), 2), -(r.get("created_at") or 0), -(r.get("id") or 0)))


def engine_cells(row: dict, health: bool | None, now: float) -> tuple:
    state = row.get("state") or "-"
    if state != "running":
        health_text = Text("-", style="dim")
    elif health is None:
        health_text = Text("?", style="yellow")
    else:
        health_text = Text("ok" if health else "down", style="green" if health else "red")
    up = None
    if state == "running" and row.get("ready_at"):
        up = now - row["ready_at"]
    elif state == "starting" and row.get("created_at"):
        up = now - row["created_at"]  # how long it has been loading
    gpus = ",".join(map(str, json.loads(row.get("gpus") or "[]"))) or "cpu"
    # The backend the builtin server chose (auto resolves at load); "-" until it is up, and for sglang/vllm.
    cells = {"JOB": str(row.get("job_id") or "-"), "KIND": row.get("kind") or "-",
             "BACKEND": row.get("backend") or "-", "MODEL": fmt.one_line(short_model(row.get("model")), 28),
             "ALGO": row.get("algorithm") or "-", "BUDGET": "-" if row.get("budget") is None else str(row["budget"]),
             "GPUS": gpus, "PORT": str(row.get("port") or "-"), "HEALTH": health_text, "UPTIME": fmt.duration(up),
             "STATE": Text(state, style={"running": "green", "failed": "red", "starting": "yellow"}.get(state, "dim"))}
    return tuple(cells[c] for c in COLUMNS)


def engines_title(rows: list[dict], show_stopped: bool) -> Text:
    live = sum(1 for r in rows if r.get("state") in LIVE_STATES)
    stopped = len(rows) - live
    out = Text.assemble(("Engines", "bold"), f"  {live} up")
    if stopped:
        out.append(f", {stopped} stopped " + ("shown" if show_stopped else "hidden"), style="dim")
        out.append("  a", style="bold")
        out.append(" hides them" if show_stopped else " shows them", style="dim")
    return out


class EnginesPane(Vertical):
    ALLOW_MAXIMIZE = True

    BINDINGS = bindings("engines")  # from the palette's table, like the help and the palette

    #: Seconds between redraws of the uptimes (the store does not change while an engine just runs).
    TICK_S = 1.0

    def compose(self) -> ComposeResult:
        with Horizontal(classes="pane-bar"):
            yield Static("Engines", id="engines-title", classes="pane-title grow")
            yield Button("New (n)", id="new-engine", compact=True)
            yield Button("Stop (x)", id="stop-engine", compact=True, variant="error")
        yield RowTable(*COLUMNS, id="engine-table")
        with Horizontal(classes="pane-bar"):
            yield Static("Log", id="log-title", classes="pane-title grow")
            yield SearchInput(placeholder="search the log", id="log-search", compact=True, leave_to="engine-table")
        yield LogView(id="engine-log")

    def on_mount(self) -> None:
        self.query_one("#log-search", Input).display = False
        self.follow, self.wrap = True, False
        self.show_stopped = False
        """Whether stopped and failed engines are listed too (key a)."""
        self.watch(self.app, "engines", self.show)
        self.set_interval(0.5, self._tail)
        self.set_interval(self.TICK_S, self.tick)

    def show(self, engines) -> None:
        self._sync(engines)
        self._open_selected()

    def _sync(self, engines) -> None:
        rows, health = engines
        now = self.app.clock()
        table = self.query_one("#engine-table", RowTable)
        shown = engine_order(rows, self.show_stopped, keep=table.cursor_key)
        sync_table(table, [(str(r["id"]), engine_cells(r, health.get(r["id"]), now)) for r in shown])
        self.query_one("#engines-title", Static).update(engines_title(rows, self.show_stopped))

    def tick(self) -> None:
        """Redraw the rows with the clock's now, so uptimes move between polls (only changed
        cells are redrawn)."""
        if self.display:
            self._sync(self.app.engines)

    def action_toggle_stopped(self) -> None:
        self.show_stopped = not self.show_stopped
        self.show(self.app.engines)

    def selected(self) -> dict | None:
        key = self.query_one("#engine-table", RowTable).cursor_key
        return next((r for r in self.app.engines[0] if str(r["id"]) == key), None)

    def _open_selected(self) -> None:
        row = self.selected()
        log = self.query_one("#engine-log", LogView)
        title = self.query_one("#log-title", Static)
        if row is None:
            title.update("Log")
            if not self.app.engines[0] or not self.query_one("#engine-table", RowTable).row_count:
                log.open(None)
                log.clear()
                hint = ("No engines yet." if not self.app.engines[0]
                        else "No engine running (a lists the stopped ones).")
                log.write(Text(f"{hint} Press n to start one (the builtin server; the demo pair by default).",
                               style="dim"))
            return
        flags = " ".join(f for f, on_ in (("follow", self.follow), ("wrap", self.wrap)) if on_)
        search = f" search {log.search!r}" if log.search else ""
        # the flags before the path: a long path is what 80 columns cut, not the state of the keys
        flags = f" ({flags})" if flags else ""
        title.update(Text(f"Log of job {row.get('job_id')}{flags}{search}: {row.get('log_path') or '-'}"))
        log.open(row.get("log_path"))

    def _tail(self) -> None:
        if self.display and self.app.current_pane == "engines":
            self.query_one("#engine-log", LogView).poll()

    def on_row_table_row_highlighted(self, _event) -> None:
        self._open_selected()

    def toggle_follow(self) -> None:
        self.follow = not self.follow
        self.query_one("#engine-log", LogView).set_follow(self.follow)
        self._open_selected()

    def toggle_wrap(self) -> None:
        self.wrap = not self.wrap
        self.query_one("#engine-log", LogView).set_wrap(self.wrap)
        self._open_selected()

    def start_search(self) -> None:
        field = self.query_one("#log-search", Input)
        field.display = True
        self.screen.set_focus(field)  # at once: the keys typed behind / are already queued

    @on(Input.Changed, "#log-search")
    def _search(self, event: Input.Changed) -> None:
        self.query_one("#engine-log", LogView).set_search(event.value)
        self._open_selected()

    @on(Input.Submitted, "#log-search")
    def _search_done(self, event: Input.Submitted) -> None:
        if not event.value:
            event.input.display = False
        self.screen.set_focus(self.query_one("#engine-table", RowTable))

    @on(SearchInput.Left, "#log-search")
    def _search_left(self, event: SearchInput.Left) -> None:
        if not event.field.value:
            event.field.display = False

    @on(Button.Pressed, "#new-engine")
    async def _new(self) -> None:
        await self.app.run_action("new_engine")

    @on(Button.Pressed, "#stop-engine")
    async def _stop(self) -> None:
        await self.app.run_action("stop_engine")


#: Per console: the engine form's fields as last started, so the form opens with them again.
LAST_FIELDS: WeakKeyDictionary = WeakKeyDictionary()


def preview(spec: dict) -> str:
    """What will run, every setting spelled out (defaults named as such): the form's last line."""
    from ddtree.engine.serving.names import display_name

    draft = display_name(spec.get("draft_model")) if spec.get("draft_model") else "none"
    if spec.get("demo"):
        model, draft = "demo/target", "demo/drafter"
    else:
        model = display_name(spec["model"])
    algorithm = spec["algorithm"]
    if algorithm == "ddtree":
        algorithm += f" budget {spec['budget'] if spec.get('budget') is not None else 'the server default'}"
    block = spec["block_size"] if spec.get("block_size") is not None else "the drafter's"
    if spec["kind"] == "builtin":
        where = f"on {spec['device']}, backend {spec.get('backend') or 'auto'}"
    else:
        gpus = ",".join(map(str, spec.get("gpus") or [])) or "0"
        where = f"on GPUs {gpus}, TP {spec.get('tp') or 1}, python {spec.get('python')}"
    return f"will run: {spec['kind']} {model} with drafter {draft}, {algorithm}, block {block}, {where}"


def device_refusal(device: str, view) -> str | None:
    """Why the builtin engine cannot run on `device` here, from the console's hardware view (the
    NVML reading the Hardware pane shows), or None: cpu, a GPU that is there, or a view not read yet.
    Only what is surely absent is refused: NVML sees at least the GPUs CUDA is shown, and an empty
    reading refuses only where it says there is no GPU (not where NVML could not finish reading)."""
    if view is None or not device.startswith("cuda"):
        return None
    if not view.gpus:
        if not view.none_here:
            return None
        return f"device {device}: this machine has no GPU ({view.reason or 'NVML found no GPU'}); use cpu"
    index = device.partition(":")[2]
    if index.isdigit() and int(index) >= len(view.gpus):
        last = len(view.gpus) - 1
        return f"device {device}: no GPU {index} here (cuda:0{'' if not last else f' to cuda:{last}'}, or cpu)"
    return None


class EngineForm(ModalScreen[dict | None]):
    """An engine server: the builtin one (model and drafter, empty = the demo pair), or SGLang/vLLM
    from a given interpreter on chosen GPUs."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="form_cancel"), *FOCUS_KEYS]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog form"):
            yield Static("Start an engine", classes="dialog-title")
            with Horizontal(classes="form-row"):
                yield Label("Engine")
                yield Select([("builtin server", "builtin"), ("SGLang", "sglang"), ("vLLM", "vllm")],
                             value="builtin", allow_blank=False, id="kind", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Model")
                yield Input(placeholder="folder or hub id; empty: the demo pair", id="model", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Drafter")
                yield Input(placeholder="DFlash drafter folder or hub id", id="draft", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Algorithm")
                yield Select([(a, a) for a in ("ddtree", "dflash", "ar")], value="ddtree", allow_blank=False,
                             id="algorithm", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Budget")
                yield Input(placeholder="DDTree node budget (default: the server's)", id="budget", type="integer",
                            compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Block size")
                yield Input(placeholder="default: the drafter's", id="block", type="integer", compact=True)
            with Horizontal(classes="form-row", id="row-device"):
                yield Label("Device")
                yield Input("cpu", id="device", placeholder="cpu, cuda or cuda:N (builtin server)", compact=True)
            with Horizontal(classes="form-row", id="row-backend"):
                yield Label("Backend")
                # auto: the fast forward (CUDA graphs) for dense Qwen3/Qwen2/Llama/Mistral on CUDA, else
                # transformers
                yield Select([("auto", "auto"), ("fast", "fast"), ("transformers", "transformers")], value="auto",
                             allow_blank=False, id="backend", compact=True)
            with Horizontal(classes="form-row", id="row-python"):
                yield Label("Python")
                yield Input(placeholder="interpreter that has sglang or vllm", id="python", compact=True)
            with Horizontal(classes="form-row", id="row-gpus"):
                yield Label("GPUs")
                yield Input(placeholder="e.g. 0,1 (tensor parallel over them)", id="gpus", compact=True)
            with Horizontal(classes="form-row", id="row-tp"):
                yield Label("TP")
                yield Input(placeholder="tensor-parallel size (default: one per GPU listed)", id="tp",
                            type="integer", compact=True)
            yield Static("", id="form-error", classes="form-error")
            with Horizontal(classes="buttons"):
                yield Button("Start", id="start", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        for field_id, value in LAST_FIELDS.get(self.app, {}).items():
            for widget in self.query(f"#{field_id}"):
                widget.value = value
        self.query_one("#model", Input).focus()
        self._show_rows()
        self.validate_form()
        # the hardware view may be read after the form opened: its GPUs decide what device is valid
        self.watch(self.app, "hardware", lambda _hw: self.validate_form(), init=False)

    def _fields(self) -> dict[str, str]:
        return {w.id: w.value for w in self.query("Input, Select") if w.id and isinstance(w.value, str)}

    def _show_rows(self) -> None:
        builtin = self.query_one("#kind", Select).value == "builtin"
        self.query_one("#row-device").display = builtin
        self.query_one("#row-backend").display = builtin
        self.query_one("#row-python").display = not builtin
        self.query_one("#row-gpus").display = not builtin
        self.query_one("#row-tp").display = not builtin

    def raw_spec(self) -> dict:
        def text(field_id: str) -> str | None:
            return self.query_one(f"#{field_id}", Input).value.strip() or None

        kind = self.query_one("#kind", Select).value
        spec: dict = {"kind": kind, "algorithm": self.query_one("#algorithm", Select).value}
        if kind == "builtin":
            spec["device"] = text("device") or "cpu"
            spec["backend"] = self.query_one("#backend", Select).value
        else:
            if text("python"):
                spec["python"] = text("python")
            if text("gpus"):
                try:
                    spec["gpus"] = [int(g) for g in text("gpus").replace(" ", "").split(",") if g]
                except ValueError:
                    spec["gpus"] = text("gpus")  # validate names it
        if text("model"):
            spec["model"] = text("model")
        if text("draft"):
            spec["draft_model"] = text("draft")
        keys = (("budget", "budget"), ("block_size", "block")) + ((("tp", "tp"),) if kind != "builtin" else ())
        for key, field_id in keys:
            value = text(field_id)
            if value is not None:
                try:
                    spec[key] = int(value)
                except ValueError:
                    spec[key] = value  # validate names it
        return spec

    def validate_form(self) -> dict | None:
        """The normalised spec, or None with the reason shown; the same check the job runs at submit."""
        from ddtree.jobs.errors import JobError
        from ddtree.jobs.kinds.engine import validate

        error = self.query_one("#form-error", Static)
        self._refused = None
        try:
            spec = validate(self.raw_spec())
        except JobError as exc:
            self._refused = str(exc)
            error.update(Text(str(exc), style="red"))
            self.query_one("#start", Button).disabled = True
            return None
        refused = self._refusal(spec)
        if refused is None and spec["kind"] == "builtin":
            refused = device_refusal(spec["device"], getattr(self.app, "gpu_view", None))
        if refused is not None:
            self._refused = refused
            error.update(Text(refused, style="red"))
            self.query_one("#start", Button).disabled = True
            return None
        error.update(Text(preview(spec), style="dim"))
        self.query_one("#start", Button).disabled = False
        return spec

    @staticmethod
    def _refusal(spec: dict) -> str | None:
        """The builtin engine's refusal of this algorithm on this target (dflash/ddtree on one with
        recurrent layers), read from its config.json now rather than from the job's log later."""
        from ddtree.engine.arch import SPECULATIVE_HINT, builtin_refusal, read_config

        if spec["kind"] != "builtin" or spec["demo"]:
            return None
        why = builtin_refusal(read_config(spec["model"]), spec["algorithm"], spec["budget"])
        return None if why is None else f"{why} ({SPECULATIVE_HINT})"

    def on_input_changed(self, _event) -> None:
        self.validate_form()

    def on_select_changed(self, _event) -> None:
        self._show_rows()
        self.validate_form()

    def on_input_submitted(self, _event) -> None:
        self._start()

    _refused: str | None = None
    """Why the form cannot start, as its last check said (None: it can)."""

    @on(Button.Pressed, "#start")
    def _start(self) -> None:
        if self.validate_form() is not None:
            LAST_FIELDS[self.app] = self._fields()
            self.dismiss(self.raw_spec())
        else:
            # as the sweep form does: Enter on a refused form says why, so it never looks ignored
            self.notify(fmt.one_line(self._refused or "the form is not valid", 200), title="cannot start",
                        severity="error")

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
