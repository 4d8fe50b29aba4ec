"""The footer: the keys valid where the focus is, redrawn as one line of text when they change.

Textual's Footer builds one widget per key and rebuilds them all whenever the bindings change,
which is at every focus change and every dialog opened or closed (30-80 ms each time on a loaded
2-core box). `KeyBar` looks the same (the footer colours of the theme, the palette key docked
right) but is two Static widgets whose text is replaced; a key is still clickable.
"""

from __future__ import annotations

from typing import ClassVar

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static


class KeyLabels(Static):
    """Keys and their descriptions; clicking one presses it."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"key-bar--key", "key-bar--description"}

    DEFAULT_CSS = """
    KeyLabels {
        height: 1;
        text-wrap: nowrap;
        & > .key-bar--key {
            color: $footer-key-foreground;
            background: $footer-key-background;
            text-style: bold;
        }
        & > .key-bar--description {
            color: $footer-description-foreground;
            background: $footer-description-background;
        }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._spans: list[tuple[int, int, str, bool]] = []

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        for start, end, key, enabled in self._spans:
            if start <= offset.x < end:
                if enabled:
                    self.app.simulate_key(key)
                else:
                    self.app.bell()
                return

    def keys_text(self, keys: list[tuple[str, str, str, bool]], *, compact: bool = False,
                  width: int | None = None) -> Text:
        """(key, shown as, description, enabled) as the Footer draws them: " key " then "description ",
        or compact (the palette key): "key" then " description". Within `width`, only whole keys:
        one that does not fit is left out rather than cut mid-word ("/ Searc")."""
        key_style = self.get_component_rich_style("key-bar--key")
        description_style = self.get_component_rich_style("key-bar--description")
        out = Text(no_wrap=True, overflow="crop")
        self._spans = []
        if width is not None:
            keys = _fitting(keys, width)
        for key, display, description, enabled in keys:
            start = out.cell_len
            dim = Style(dim=not enabled)
            out.append(display if compact else f" {display} ", key_style + dim)
            if description:
                out.append(f" {description}" if compact else f"{description} ", description_style + dim)
            self._spans.append((start, out.cell_len, key, enabled))
        return out


# Kept when a narrow bar leaves keys out: how to leave, and where every other key is listed.
PINNED_KEYS = ("question_mark", "q")


def _fitting(keys: list[tuple[str, str, str, bool]], width: int) -> list[tuple[str, str, str, bool]]:
    """The keys that fit `width` whole, in their order: the pinned ones first claim their room,
    then the rest in order while they fit (a key's trailing space may fall off the edge)."""
    def cells(entry) -> int:
        _, display, description, _ = entry
        return cell_len(display) + 2 + (cell_len(description) + 1 if description else 0)

    pinned = [entry for entry in keys if entry[0] in PINNED_KEYS]
    room = width + 1 - sum(cells(entry) for entry in pinned)
    if room < 0:  # not even the pinned ones: the first keys that fit, in order
        pinned, room = [], width + 1
    kept = set(map(id, pinned))
    for entry in keys:
        if id(entry) in kept:
            continue
        if cells(entry) > room:
            break
        kept.add(id(entry))
        room -= cells(entry)
    return [entry for entry in keys if id(entry) in kept]


class KeyBar(Horizontal):
    """Docked at the bottom of the screen it is composed in."""

    DEFAULT_CSS = """
    KeyBar {
        dock: bottom;
        height: 1;
        color: $footer-foreground;
        background: $footer-background;
        #keys {
            width: 1fr;
        }
        #palette-key {
            dock: right;
            width: auto;
            padding-right: 1;
            border-left: vkey $foreground 20%;
        }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple | None = None

    def compose(self) -> ComposeResult:
        yield KeyLabels(id="keys")
        yield KeyLabels(id="palette-key")

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)
        self.call_after_refresh(self.update_keys)

    def on_resize(self, _event) -> None:
        # the keys that fit change with the width (the labels' own size is set by this layout)
        self.call_after_refresh(self.update_keys)

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _bindings_changed(self, screen) -> None:
        if self.is_attached and screen is self.screen:
            self.call_after_refresh(self.update_keys)

    def update_keys(self) -> None:
        """Show the keys of the screen's active bindings (one per action, as the Footer does)."""
        app = self.app
        keys: list[tuple[str, str, str, bool]] = []
        seen: set[str] = set()
        palette = None
        for key, (_node, binding, enabled, _tooltip) in self.screen.active_bindings.items():
            if app.ENABLE_COMMAND_PALETTE and key == app.COMMAND_PALETTE_BINDING:
                palette = (binding.key, app.get_key_display(binding), binding.description, enabled)
                continue
            if not binding.show or binding.action in seen:
                continue
            seen.add(binding.action)
            keys.append((binding.key, app.get_key_display(binding), binding.description, enabled))
        labels = self.query_one("#keys", KeyLabels)
        width = labels.size.width or None  # None before the first layout: all of them
        shown = (tuple(keys), palette, width)
        if shown == self._shown:
            return
        self._shown = shown
        labels.update(labels.keys_text(keys, width=width))
        palette_key = self.query_one("#palette-key", KeyLabels)
        palette_key.display = palette is not None
        if palette is not None:
            palette_key.update(palette_key.keys_text([palette], compact=True))
