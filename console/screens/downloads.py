"""Downloads: bytes, files, rate, ETA, a bar and disk headroom per download; start and stop them."""

from __future__ import annotations

import json

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.validation import Function, Number, ValidationResult, Validator
from textual.widgets import Button, Input, Label, Static

from ddtree.console import fmt
from ddtree.console.eta import download_eta
from ddtree.console.screens.modals import FOCUS_KEYS
from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.widgets.tables import bar, fmt_bytes, fmt_rate, sync_table

# Progress, rate, ETA and headroom before the byte and file counts: at 80 columns those stay on screen.
COLUMNS = ("JOB", "REPO", "STATE", "PROGRESS", "RATE", "ETA", "FREE AFTER", "BYTES", "FILES")


def headroom_after(row: dict) -> int | None:
    """Free bytes on the target disk once the rest has arrived."""
    free, total, done = row.get("disk_free_bytes"), row.get("bytes_total"), row.get("bytes_done") or 0
    if free is None or total is None:
        return None
    return free - max(0, total - done)


def download_cells(row: dict, now: float | None = None) -> tuple:
    total, done = row.get("bytes_total"), row.get("bytes_done")
    frac = (done or 0) / total if total else None
    after = headroom_after(row)
    reserve = row.get("reserve_bytes")
    after_text = Text(fmt_bytes(after), style="red" if after is not None and reserve and after < reserve else "")
    state = row.get("state") or "-"
    eta = None
    if state in ("running", "stalled"):
        eta = row.get("eta_s") if now is None else download_eta(row, now)
    return (str(row.get("job_id") or "-"), fmt.one_line(row.get("repo_id"), 34),
            Text(state, style={"stalled": "yellow", "failed": "red", "succeeded": "green"}.get(state, "")),
            bar(frac, 8), fmt_rate(row.get("rate_bps")) if state in ("running", "stalled") else "-",
            fmt.duration(eta), after_text, f"{fmt_bytes(done)}/{fmt_bytes(total)}",
            f"{row.get('files_done') or 0}/{row.get('files_total') or 0}")


class DownloadsPane(Vertical):
    ALLOW_MAXIMIZE = True

    BINDINGS = [
        Binding("d", "app.new_download", "New download", id="new_download"),
        Binding("x", "app.stop_download", "Stop", id="stop_download"),
    ]

    def compose(self) -> ComposeResult:
        with Horizontal(classes="pane-bar"):
            yield Static("Downloads", classes="pane-title grow")
            yield Button("New (d)", id="new-download", compact=True)
            yield Button("Stop (x)", id="stop-download", compact=True, variant="error")
        yield RowTable(*COLUMNS, id="download-table")
        yield Static("", id="download-detail")

    def on_mount(self) -> None:
        self.watch(self.app, "downloads", self.show)
        self.set_interval(1.0, self.tick)

    def tick(self) -> None:
        """Redraw the rows with the clock's now, so ETAs count down between the downloader's updates."""
        if self.display:
            self._sync(self.app.downloads)

    def _sync(self, rows: list[dict]) -> None:
        now = self.app.clock()
        sync_table(self.query_one("#download-table", RowTable), [(str(r["id"]), download_cells(r, now)) for r in rows])

    def show(self, rows: list[dict]) -> None:
        self._sync(rows)
        detail = self.query_one("#download-detail", Static)
        if not rows:
            detail.update(Text("No downloads yet. Press d to start one (a Hugging Face repo id).", style="dim"))
            return
        row = self.selected()
        if row is not None:
            include = ", ".join(json.loads(row.get("include") or "[]")) or "all files"
            text = f"{row['repo_id']} @ {row.get('revision') or 'main'} ({include}) -> {row.get('local_dir') or 'HF cache'}"
            if row.get("error"):
                text += f"\nerror: {row['error']}"
            detail.update(Text(text, style="red" if row.get("error") else "dim"))

    def selected(self) -> dict | None:
        key = self.query_one("#download-table", RowTable).cursor_key
        return next((r for r in self.app.downloads if str(r["id"]) == key), None)

    def on_row_table_row_highlighted(self, _event) -> None:
        self.show(self.app.downloads)

    @on(Button.Pressed, "#new-download")
    async def _new(self) -> None:
        await self.app.run_action("new_download")

    @on(Button.Pressed, "#stop-download")
    async def _stop(self) -> None:
        await self.app.run_action("stop_download")


class RepoId(Validator):
    def validate(self, value: str) -> ValidationResult:
        from ddtree.engine.machine.download import DownloadError, DownloadSpec

        try:
            DownloadSpec(repo_id=value.strip())
        except DownloadError as exc:
            return self.failure(exc.message)
        return self.success()


class SpecField(Validator):
    """One field of the form, checked by DownloadSpec itself (so the form and the CLI agree)."""

    def __init__(self, field: str) -> None:
        super().__init__()
        self.field = field

    def validate(self, value: str) -> ValidationResult:
        from ddtree.engine.machine.download import DownloadError, DownloadSpec

        if self.field == "revision":
            given = {"revision": value.strip()} if value.strip() else {}
        else:
            given = {self.field: tuple(split_list(value))}
        try:
            DownloadSpec(repo_id="a/b", **given)
        except DownloadError as exc:
            return self.failure(exc.message)
        return self.success()


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.replace(";", ",").split(",") if part.strip()]


class DownloadForm(ModalScreen[dict | None]):
    """Repo id, include and exclude globs, revision, reserve, local folder; the Start button
    works only when every field is valid."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="form_cancel"), *FOCUS_KEYS]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog form"):
            yield Static("Start a download", classes="dialog-title")
            with Horizontal(classes="form-row"):
                yield Label("Repo id")
                yield Input(placeholder="org/name, e.g. Qwen/Qwen3-8B", id="repo", validators=[RepoId()], compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Include")
                yield Input(placeholder="globs, comma separated (empty: all files)", id="include",
                            validators=[SpecField("include")], compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Exclude")
                yield Input(placeholder="globs to skip, e.g. *.pth (empty: none)", id="exclude",
                            validators=[SpecField("exclude")], compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Revision")
                yield Input(placeholder="branch, tag or commit (empty: main)", id="revision",
                            validators=[SpecField("revision")], compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Reserve GB")
                yield Input(placeholder="default: 5% of disk, >= 10", id="reserve", type="number",
                            validators=[Function(lambda v: v == "" or _finite(v), "a number of GB >= 0"),
                                        Number(minimum=0)], valid_empty=True, compact=True)
            with Horizontal(classes="form-row"):
                yield Label("Local dir")
                yield Input(placeholder="empty: the Hugging Face cache", id="local-dir", compact=True)
            yield Static("", id="form-error", classes="form-error")
            with Horizontal(classes="buttons"):
                yield Button("Start", id="start", variant="primary", disabled=True)
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#repo", Input).focus()

    def spec(self) -> dict | None:
        """The download job spec, or None while a field is invalid (the reason is shown)."""
        repo = self.query_one("#repo", Input)
        problems = []
        for field in self.query(Input):
            if field.id == "repo" and not field.value.strip():
                problems.append("repo id: required")
                continue
            result = field.validate(field.value)
            if result is not None and not result.is_valid:
                problems.append(f"{field.id}: {'; '.join(result.failure_descriptions)}")
        error = self.query_one("#form-error", Static)
        error.update("\n".join(problems))
        if problems:
            return None
        spec: dict = {"repo_id": repo.value.strip(), "include": split_list(self.query_one("#include", Input).value)}
        exclude = split_list(self.query_one("#exclude", Input).value)
        if exclude:
            spec["exclude"] = exclude
        revision = self.query_one("#revision", Input).value.strip()
        if revision:
            spec["revision"] = revision
        reserve = self.query_one("#reserve", Input).value.strip()
        if reserve:
            spec["reserve_bytes"] = int(float(reserve) * 1e9)
        local = self.query_one("#local-dir", Input).value.strip()
        if local:
            spec["local_dir"] = local
        return spec

    def on_input_changed(self, _event: Input.Changed) -> None:
        self.query_one("#start", Button).disabled = self.spec() is None

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self._start()

    @on(Button.Pressed, "#start")
    def _start(self) -> None:
        spec = self.spec()
        if spec is not None:
            self.dismiss(spec)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def _finite(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return value == value and value not in (float("inf"), float("-inf"))
