"""A log file viewer: tails the file as it grows (follow), filters lines by a text (search), wraps.

Reading happens in `poll()`, which the owner calls on a timer; it reads only the bytes appended
since the last call (at most the last `max_bytes` on the first read), so a large log costs nothing
per tick. A truncated or replaced file is read again from its start.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.text import Text
from textual.widgets import RichLog

#: The most of a log's end read on opening it.
MAX_BYTES = 256 * 1024
MAX_LINES = 5000


class LogView(RichLog):
    DEFAULT_CSS = """
    LogView {
        height: 1fr;
        min-height: 4;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None, wrap: bool = False) -> None:
        super().__init__(id=id, classes=classes, max_lines=MAX_LINES, wrap=wrap, markup=False, highlight=False, auto_scroll=True)
        self.path: Path | None = None
        self.read_at = 0
        self.inode: int | None = None
        self.partial = ""
        self.raw_lines: list[str] = []
        self.search = ""
        self._wrapped_at: int | None = None
        """The width the lines were last laid out at (wrapped lines are laid out again on a new one)."""

    def on_resize(self, event) -> None:
        # RichLog wraps a line once, as it is written: a wider or narrower pane would keep the old
        # breaks, cut or ragged. (RichLog's own handler still runs: Textual calls both.)
        width = event.size.width
        if self.wrap and self.raw_lines and self._wrapped_at not in (None, width):
            self.call_after_refresh(self._rewrite)
        self._wrapped_at = width

    def open(self, path: str | os.PathLike | None) -> None:
        new = Path(path) if path else None
        if new == self.path and new is not None:
            return
        self.path, self.read_at, self.inode, self.partial, self.raw_lines = new, 0, None, "", []
        self.clear()
        if new is None:
            self.write(Text("no log file for this engine", style="dim"))
        self.poll()
        if new is not None and not self.raw_lines and new.is_file():
            self.write(Text(f"{new}: empty so far", style="dim"))  # cleared by the first line

    def poll(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except OSError:
            if not self.raw_lines:
                self.clear()
                self.write(Text(f"{self.path}: not there yet", style="dim"))
            return
        if self.inode != st.st_ino or st.st_size < self.read_at:
            self.inode, self.partial, self.raw_lines = st.st_ino, "", []
            self.read_at = max(0, st.st_size - MAX_BYTES)
            self.clear()
        if st.st_size == self.read_at:
            return
        with open(self.path, "rb") as fh:
            fh.seek(self.read_at)
            chunk = fh.read(st.st_size - self.read_at)
        self.read_at += len(chunk)
        parts = (self.partial + chunk.decode(errors="replace")).split("\n")
        self.partial = parts.pop()
        if not self.raw_lines and not parts:
            return
        if not self.raw_lines:
            self.clear()
        self.raw_lines.extend(parts)
        del self.raw_lines[:-MAX_LINES]
        for line in parts:
            if self._matches(line):
                self.write(self._styled(line))

    def _matches(self, line: str) -> bool:
        return not self.search or self.search.lower() in line.lower()

    def _styled(self, line: str) -> Text:
        text = Text(line)
        if self.search:
            text.highlight_words([self.search], style="reverse", case_sensitive=False)
        elif "error" in line.lower() or "traceback" in line.lower():
            text.stylize("red")
        return text

    def set_search(self, text: str) -> None:
        self.search = text.strip()
        self._rewrite()

    def set_wrap(self, wrap: bool) -> None:
        self.wrap = wrap
        self._rewrite()

    def set_follow(self, follow: bool) -> None:
        self.auto_scroll = follow
        if follow:
            self.scroll_end(animate=False)

    def _rewrite(self) -> None:
        self.clear()
        for line in self.raw_lines:
            if self._matches(line):
                self.write(self._styled(line))
