"""One run from History: its points, settings, environment and logs (Enter on a run opens it)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ddtree.console import fmt
from ddtree.console.screens.modals import FOCUS_KEYS
from ddtree.console.screens.sweeps import POINT_COLUMNS, point_cells
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
        from ddtree.console.screens.history import _recipe_settings, _software, hardware_summary

        run = self.run
        with VerticalScroll(classes="dialog full", id="run-detail"):
            head = f"Run {run.id}: {run.name or '-'}   {run.state or '-'}   (esc closes)"
            yield Static(head, classes="dialog-title")
            if run.error:
                yield Static(Text(f"error: {run.error}", style="red"), id="run-error")
            yield Static(Text(f"Points ({len(self.points)})", style="bold underline"))
            yield RowTable(*POINT_COLUMNS, id="run-points")
            yield Static(_block("Settings", _recipe_settings(run)), id="run-settings")
            env = {"hardware": hardware_summary(run.hardware), "software": _software(run),
                   "recipe file": run.recipe_path or "(typed in the form)", "git rev": run.recipe_git_rev or "-"}
            yield Static(_block("Environment", env), id="run-env")
            log = Text()
            log.append(f"Log (last {LOG_LINES} lines): {self.log_path or '-'}\n", style="bold underline")
            log.append("\n".join(log_tail(self.log_path)), style="dim")
            yield Static(log, id="run-log")

    def on_mount(self) -> None:
        table = self.query_one("#run-points", RowTable)
        table.set_rows([(str(p.id), point_cells(p)) for p in self.points])
        self.set_focus(table)

    def action_close(self) -> None:
        self.dismiss(None)
