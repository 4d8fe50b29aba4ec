"""Dialogs: confirm before stopping anything, and the help screen."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
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


#: Where a key's text starts in the help: two spaces, the key, padding. Lines of a text too long
#: for the dialog go on under the text, not under the keys.
HELP_KEY_W = 8


def _key_rows(rows: list[tuple[str, ...]], title_w: int = 0) -> Table:
    """(key, text) rows, or (key, title, text) with `title_w`, as columns: a text wraps within its
    own column (a hanging indent), not back under the key."""
    table = Table.grid(expand=True)
    table.add_column(width=HELP_KEY_W, no_wrap=True, style="bold")
    if title_w:
        table.add_column(width=title_w, no_wrap=True)
    table.add_column(ratio=1)
    for key, *cells in rows:
        table.add_row(f"  {key}", *cells)
    return table


def help_text(db_path: str = "") -> Group:
    intro = Text()
    intro.append("ddtree-console", style="bold")
    intro.append(" — every key; ctrl+p opens the palette with all of them.")
    if db_path:
        intro.append(f"\nstore: {db_path}", style="dim")
    parts: list = [intro, Text(""), Text("Panes", style="bold underline"),
                   _key_rows([(key, title, text) for _pane, key, title, text in PANES], title_w=11)]
    groups: dict[str | None, list] = {}
    for a in ACTIONS:
        if a.action.startswith("show_pane"):
            continue
        groups.setdefault(a.pane, []).append(a)
    for pane, actions in groups.items():
        parts += [Text(""), Text((pane or "everywhere").capitalize(), style="bold underline"),
                  _key_rows([(a.key or "-", f"{a.title} — {a.help}") for a in actions])]
    parts += [Text(""), Text("Jobs run detached: closing the console (or losing SSH) leaves them running.",
                             style="dim")]
    return Group(*parts)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close", id="help_close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help", classes="dialog"):
            yield Static(help_text(str(getattr(self.app, "db_path", ""))))

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
