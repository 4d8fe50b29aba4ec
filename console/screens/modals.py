"""Dialogs: confirm before stopping anything, and the help screen."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from ddtree.console.palette import ACTIONS, PANES

# Textual (8.2.8 and earlier; no release fixes it) routes a key to the widget focused when the app
# takes the key off its queue, but runs a screen's ordinary Tab binding only after the key has come
# back up from that widget. Keys typed right behind Tab were already routed to the old field, so
# fast typing lost the Tab. Priority bindings run before routing, so focus moves first.
FOCUS_KEYS = [
    Binding("tab", "app.focus_next", "Next field", show=False, priority=True),
    Binding("shift+tab", "app.focus_previous", "Previous field", show=False, priority=True),
]


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no; Enter or y confirms, Escape or n declines."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm_yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm_no"),
        *FOCUS_KEYS,
    ]

    def __init__(self, question: str, *, yes: str = "Stop it") -> None:
        super().__init__()
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Static(self.question, id="question")
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


def help_text(db_path: str = "") -> Text:
    out = Text()
    out.append("ddtree-console", style="bold")
    out.append(" — every key; ctrl+p opens the palette with all of them.\n")
    if db_path:
        out.append(f"store: {db_path}\n", style="dim")
    out.append("\n")
    out.append("Panes\n", style="bold underline")
    for pane, key, title, text in PANES:
        out.append(f"  {key:<6}", style="bold")
        out.append(f"{title:<11}{text}\n")
    groups: dict[str | None, list] = {}
    for a in ACTIONS:
        if a.action.startswith("show_pane"):
            continue
        groups.setdefault(a.pane, []).append(a)
    for pane, actions in groups.items():
        out.append(f"\n{(pane or 'everywhere').capitalize()}\n", style="bold underline")
        for a in actions:
            out.append(f"  {(a.key or '-'):<6}", style="bold")
            out.append(f"{a.title} — {a.help}\n")
    out.append("\nJobs run detached: closing the console (or losing SSH) leaves them running.\n", style="dim")
    return out


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close", id="help_close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help", classes="dialog"):
            yield Static(help_text(str(getattr(self.app, "db_path", ""))))

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
