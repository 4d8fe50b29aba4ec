"""One run from History: the budget to serve with, regressions against earlier runs of its
fingerprint, its points, the acceptance heatmap, settings, environment and logs (Enter on a run
opens it)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ddtree.console import fmt
from ddtree.console.screens.modals import FOCUS_KEYS
from ddtree.console.screens.sweeps import POINT_COLUMNS, insight_text, point_cells, run_ended
from ddtree.console.widgets.heatmap import heatmap_text
from ddtree.console.widgets.rowtable import RowTable

LOG_LINES = 40


def log_tail(path: str | None, lines: int = LOG_LINES) -> list[str]:
    """The last lines of a log file; a missing or unreadable file reads as a note, not an error."""
    if not path:
        return ["(no log recorded)"]
    try:
        with open(Path(path), "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))  # the tail only: logs of long sweeps grow large
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return [f"(cannot read {path}: {exc.strerror or exc})"]
    return text.splitlines()[-lines:] or ["(empty)"]


def _block(title: str, value) -> Text:
    out = Text()
    out.append(f"{title}\n", style="bold underline")
    if isinstance(value, dict):
        for key, item in value.items():
            shown = json.dumps(item, default=str) if isinstance(item, (dict, list)) else str(item)
            out.append(f"  {key:<18}", style="bold")
            out.append(fmt.one_line(shown, 200) + "\n")
    else:
        out.append(f"  {value}\n")
    return out


def sentinel_block(report) -> Text:
    """The Sentinel section: what the run was compared with, then each flag in red."""
    out = Text("Sentinel\n", style="bold underline")
    out.append(f"  {report.summary_text}\n", style="" if report.flagged else "dim")
    for line in report.lines:
        out.append(f"  ⚠ {line}\n", style="bold red")
    return out


class RunScreen(ModalScreen[None]):
    """A run's points, settings (the recipe), environment (hardware, software) and log tail."""

    DEFAULT_CSS = """
    RunScreen {
        background: $background;
    }
    RunScreen #run-points {
        height: auto;
        max-height: 16;
    }
    """

    BINDINGS = [Binding("escape,q", "close", "Close", id="run_close"), *FOCUS_KEYS]

    def __init__(self, run, points: list, log_path: str | None) -> None:
        super().__init__()
        self.run, self.points, self.log_path = run, points, log_path

    def compose(self) -> ComposeResult:
        from ddtree.console.screens.history import hardware_summary, recipe_settings, software_line

        run = self.run
        with VerticalScroll(classes="dialog full", id="run-detail"):
            head = f"Run {run.id}: {run.name or '-'}   {run.state or '-'}   (esc closes)"
            yield Static(head, classes="dialog-title")
            if run.error:
                yield Static(Text(f"error: {run.error}", style="red"), id="run-error")
            rec = Text("Budget to serve with\n", style="bold underline")
            rec.append_text(insight_text(self.points, prefix="  ") or Text("  no DDTree budget measured", style="dim"))
            yield Static(rec, id="run-recommendation")
            yield Static(Text("Sentinel\n  reading earlier runs of this fingerprint…", style="dim"), id="run-sentinel")
            yield Static(Text(f"Points ({len(self.points)})", style="bold underline"))
            yield RowTable(*POINT_COLUMNS, id="run-points")
            heat = Text("Acceptance per round\n", style="bold underline")
            heat.append_text(heatmap_text(self.points, 96))
            yield Static(heat, id="run-heatmap")
            yield Static(_block("Settings", recipe_settings(run)), id="run-settings")
            env = {"hardware": hardware_summary(run.hardware), "software": software_line(run),
                   "recipe file": run.recipe_path or "(typed in the form)", "git rev": run.recipe_git_rev or "-"}
            yield Static(_block("Environment", env), id="run-env")
            log = Text()
            log.append(f"Log (last {LOG_LINES} lines): {self.log_path or '-'}\n", style="bold underline")
            log.append("\n".join(log_tail(self.log_path)), style="dim")
            yield Static(log, id="run-log")

    def on_mount(self) -> None:
        table = self.query_one("#run-points", RowTable)
        table.set_rows([(str(p.id), point_cells(p, run_ended(self.run))) for p in self.points])
        self.set_focus(table)
        self._sentinel()

    @work(thread=True, group="run-sentinel", exit_on_error=False)
    def _sentinel(self) -> None:
        from ddtree.store.errors import StoreError
        from ddtree.store.sentinel import check_run

        try:
            with self.app.reading() as db:
                report = check_run(db, self.run, self.points)
        except StoreError as exc:
            self.app.call_from_thread(self._show_sentinel, Text(f"Sentinel\n  cannot read the history: {exc}",
                                                                 style="red"))
            return
        self.app.call_from_thread(self._show_sentinel, sentinel_block(report))

    def _show_sentinel(self, text: Text) -> None:
        if self.is_attached:
            self.query_one("#run-sentinel", Static).update(text)

    def action_close(self) -> None:
        self.dismiss(None)
