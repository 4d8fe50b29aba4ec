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
    """Yes/no: y confirms, n or Escape declines, Enter presses the focused button (the one named
    under the buttons; No to begin with, so a stray Enter stops nothing)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm_yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm_no"),
        *FOCUS_KEYS,
        Binding("left,right", "app.focus_next", "Other button", show=False, priority=True),
    ]

    def __init__(self, question: str, *, yes: str = "Stop it", no: str = "Keep it running") -> None:
        super().__init__()
        self.question = question
        self.yes = yes
        self.no = no

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Static(self.question, id="question")
            with Horizontal(classes="buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button(f"{self.no} (n/Esc)", id="no")
            yield Static("", id="confirm-keys", classes="dialog-keys")

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#no", Button))

    def on_descendant_focus(self, event) -> None:
        self._show_enter(event.widget)

    def _show_enter(self, widget) -> None:
        label = {"yes": self.yes, "no": self.no}.get(getattr(widget, "id", None))
        keys = Text()
        keys.append("y", style="bold")
        keys.append(f" {self.yes.lower()}   ")
        keys.append("n", style="bold")
        keys.append(" or ")
        keys.append("Esc", style="bold")
        keys.append(f" {self.no.lower()}   ")
        keys.append("Tab", style="bold")
        keys.append(" other button")
        if label:
            keys.append("\nEnter", style="bold")
            keys.append(": ")
            keys.append(label, style="reverse")
        self.query_one("#confirm-keys", Static).update(keys)

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
