"""A one-line filter or search box that Escape leaves, handing focus back to the table beside it."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input


class SearchInput(Input):
    """`leave_to`: the id of the widget that Escape focuses."""

    # Priority, so focus has moved before the keys typed right behind Escape are routed: `Esc 5`
    # switches pane instead of typing 5 (see FOCUS_KEYS in screens/modals.py for the why).
    BINDINGS = [Binding("escape", "leave", "Back to the table", show=False, priority=True)]

    def __init__(self, *args, leave_to: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leave_to = leave_to

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
