"""A one-line filter or search box that Escape leaves, handing focus back to the table beside it."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input


class SearchInput(Input):
    """`leave_to`: the id of the widget that Escape focuses. `hints`: placeholders, longest first;
    the box shows the longest that fits its width whole, whenever that width changes."""

    # Priority, so focus has moved before the keys typed right behind Escape are routed: `Esc 5`
    # switches pane instead of typing 5 (see FOCUS_KEYS in screens/modals.py for the why).
    BINDINGS = [Binding("escape", "leave", "Back to the table", show=False, priority=True)]

    def __init__(self, *args, leave_to: str, hints: tuple[str, ...] = (), **kwargs) -> None:
        if hints:
            kwargs.setdefault("placeholder", hints[0])
        super().__init__(*args, **kwargs)
        self.leave_to = leave_to
        self.hints = hints

    def on_resize(self, _event) -> None:
        # The box's own size: a pane's neighbours (a title that grows) change it with no resize
        # of the pane, which a pane-level fit missed on a loaded machine.
        if self.hints:
            room = self.content_size.width
            self.placeholder = next((h for h in self.hints if len(h) <= room), self.hints[-1])

    class Left(Message):
        """Escape was pressed in the box; the box keeps its text."""

        def __init__(self, field: "SearchInput") -> None:
            super().__init__()
            self.field = field

        @property
        def control(self) -> "SearchInput":
            return self.field

    def action_leave(self) -> None:
        # Screen.set_focus, not Widget.focus: the latter waits for the queue, and the next key with it.
        self.screen.set_focus(self.screen.query_one(f"#{self.leave_to}"))
        self.post_message(self.Left(self))
