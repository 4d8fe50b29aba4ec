"""A read-only table that draws only the rows on screen, for tables that change as a whole.

Textual's DataTable measures every cell of every new row (to size its columns) and renders each
visible cell through Rich's layout engine; at 200 rows that costs about 100 ms per replacement of
the rows, which the History pane does on every filter keystroke. `RowTable` keeps the rows as
given, sizes columns from string lengths, and builds each visible line straight from segments
(cached per row until the row, the widths, the cursor or the styles change). It looks like a
DataTable with a row cursor and zebra stripes (same component styles) and posts the same kind of
messages, with row keys as plain strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size, Spacing
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.scrollbar import ScrollDown, ScrollTo, ScrollUp
from textual.strip import Strip

from ddtree.console.fmt import printable

Cell = str | Text
Row = tuple[str, Sequence[Cell]]

_PAD = 1  # spaces either side of a cell, as DataTable's default cell padding


def _printable(cell: Cell) -> Cell:
    """A cell with control and bidi characters escaped (fmt.printable): cells show stored text
    (run names, errors), and a raw ESC or U+202E would reach the terminal."""
    if isinstance(cell, Text):
        safe = printable(cell.plain)
        return cell if safe == cell.plain else Text(safe, style=cell.style)
    return printable(cell) if isinstance(cell, str) else cell


def word_cut(text: str, width: int) -> int:
    """How many characters of `text` to show in `width` cells followed by an ellipsis: up to the
    last space when that keeps at least half of them, else as many as fit (one long word)."""
    limit, used, n = width - 1, 0, 0
    for ch in text:
        used += cell_len(ch)
        if used > limit:
            break
        n += 1
    space = text.rfind(" ", 0, n + 1)
    if space >= limit // 2:
        n = space
    while n and text[n - 1] in " ,;:":
        n -= 1
    return n


def clip_cell(cell: Cell, width: int) -> Cell:
    """`cell` cut to `width` cells at a word break, with an ellipsis (unchanged when it fits)."""
    text = cell.plain if isinstance(cell, Text) else str(cell)
    if cell_len(text) <= width:
        return cell
    n = word_cut(text, width)
    if isinstance(cell, Text):
        return Text.assemble(cell[:n], "…", style=cell.style)
    return text[:n] + "…"


#: The fewest cells a cell at the right edge is clipped to (with its ellipsis); in less, it is cut.
MIN_CLIP = 4


class RowTable(ScrollView, can_focus=True):
    """Rows keyed by strings, a header, a row cursor; replace the rows with `set_rows`."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Select", show=False),
        Binding("up", "cursor_up", "Cursor up", show=False),
        Binding("down", "cursor_down", "Cursor down", show=False),
        Binding("right", "scroll_right", "Scroll right", show=False),
        Binding("left", "scroll_left", "Scroll left", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("ctrl+home,home", "first", "First row", show=False),
        Binding("ctrl+end,end", "last", "Last row", show=False),
    ]

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "row-table--header", "row-table--cursor", "row-table--even-row", "row-table--odd-row",
    }

    # The DataTable's look, under our component names.
    DEFAULT_CSS = """
    RowTable {
        background: $surface;
        color: $foreground;
        height: auto;
        max-height: 100%;

        &:focus {
            background-tint: $foreground 5%;
            & > .row-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
            & > .row-table--header {
                background-tint: $foreground 5%;
            }
        }
        &:dark {
            & > .row-table--even-row {
                background: $surface-darken-1 40%;
            }
        }
        & > .row-table--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        &:ansi > .row-table--header {
            background: ansi_bright_blue;
            color: ansi_default;
        }
        & > .row-table--odd-row {
        }
        & > .row-table--even-row {
            background: $surface-lighten-1 50%;
        }
        & > .row-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
    }
    """

    cursor_row: reactive[int] = reactive(0, always_update=False, repaint=False)
    """Index of the highlighted row (0 when the table is empty)."""

    class _RowMessage(Message):
        def __init__(self, table: RowTable, cursor_row: int, row_key: str) -> None:
            super().__init__()
            self.table, self.cursor_row, self.row_key = table, cursor_row, row_key

        @property
        def control(self) -> RowTable:
            return self.table

    class RowHighlighted(_RowMessage):
        """The cursor moved to another row."""

    class RowSelected(_RowMessage):
        """Enter on the cursor row, or a click on it."""

    def __init__(self, *columns: str, zebra_stripes: bool = True, name: str | None = None, id: str | None = None,
                 classes: str | None = None, disabled: bool = False) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self.zebra_stripes = zebra_stripes
        self._labels: tuple[str, ...] = tuple(columns)
        self._rows: list[Row] = []
        self._index: dict[str, int] = {}
        self._widths: list[int] = [cell_len(label) for label in self._labels]
        self._strips: dict[tuple, Strip] = {}
        self._look: tuple | None = None
        self._now: tuple | None = None
        self._top_row: int | None = None  # scroll_row_to_top's row, until the cursor moves
        self._top_short: int | None = None  # where that scroll stopped short of the row (clamped)

    # -- data ------------------------------------------------------------------------------------
    def set_columns(self, *labels: str) -> None:
        self._labels = tuple(labels)
        self._reset_widths()

    @property
    def row_count(self) -> int:
        return len(self._rows)

    def get_row_at(self, index: int) -> list[Cell]:
        return list(self._rows[index][1])

    def row_key_at(self, index: int) -> str | None:
        return self._rows[index][0] if 0 <= index < len(self._rows) else None

    @property
    def cursor_key(self) -> str | None:
        """Key of the row under the cursor (None when empty)."""
        return self.row_key_at(self.cursor_row)

    def set_rows(self, rows: Iterable[Row]) -> None:
        """Show `rows` (key, cells), keeping the cursor on the same key where it still exists.

        Rows whose cells did not change keep their drawn lines; nothing is measured beyond
        the string lengths of the new cells.
        """
        rows = [(str(key), tuple(_printable(cell) for cell in cells)) for key, cells in rows]
        old_rows, old_key = self._rows, self.cursor_key
        same_keys = len(rows) == len(old_rows) and all(a[0] == b[0] for a, b in zip(rows, old_rows))
        self._rows = rows
        self._index = {key: n for n, (key, _) in enumerate(rows)}
        if old_rows and not any(key in self._index for key, _ in old_rows):
            self._forget_top()  # other rows (another run): the row to show first was the old rows'
        widths_changed = self._reset_widths()
        if same_keys and not widths_changed:
            changed = [n for n, (new, old) in enumerate(zip(rows, old_rows)) if new[1] != old[1]]
            for n in changed:
                self._forget_row(n)
            for n in changed:
                self.refresh_line(n)
            return
        self._strips.clear()
        target = self._index.get(old_key, 0) if old_key is not None else 0
        self.cursor_row = max(0, min(target, len(rows) - 1))
        self.refresh()

    def clear(self) -> None:
        self.set_rows([])

    def _reset_widths(self) -> bool:
        widths = [cell_len(label) for label in self._labels]
        for _, cells in self._rows:
            for n, cell in enumerate(cells[: len(widths)]):
                length = cell.cell_len if isinstance(cell, Text) else cell_len(cell)
                if length > widths[n]:
                    widths[n] = length
        changed = widths != self._widths
        self._widths = widths
        total = sum(w + 2 * _PAD for w in widths)
        size = Size(total, len(self._rows) + 1)
        if changed:
            self._strips.clear()
        if size != self.virtual_size:
            self.virtual_size = size
            self._range_changed()
        return changed

    def _forget_row(self, index: int) -> None:
        for key in [k for k in self._strips if k[0] == index]:
            del self._strips[key]

    def refresh_line(self, index: int) -> None:
        """Redraw the row at `index` if it is on screen."""
        y = index + 1 - self.scroll_offset.y
        if 1 <= y < self.size.height:
            self.refresh(Region(0, y, self.size.width, 1))

    # -- cursor ----------------------------------------------------------------------------------
    def move_cursor(self, *, row: int, scroll: bool = True) -> None:
        if not self._rows:
            return
        self.cursor_row = max(0, min(row, len(self._rows) - 1))
        if scroll:
            self._scroll_to_cursor()

    def validate_cursor_row(self, row: int) -> int:
        return max(0, min(row, len(self._rows) - 1)) if self._rows else 0

    def watch_cursor_row(self, old: int, new: int) -> None:
        self._forget_row(old)
        self._forget_row(new)
        self.refresh_line(old)
        self.refresh_line(new)
        key = self.row_key_at(new)
        if key is not None:
            self.post_message(self.RowHighlighted(self, new, key))

    def scroll_row_to_top(self, index: int) -> None:
        """Show row `index` first, and again after each resize, until the cursor moves, the user
        scrolls, or the rows are replaced by others. A scroll made before the last layout is
        clamped to the range before it: the table's height follows the widgets around it (a
        Resize), while rows arriving or a horizontal scrollbar taking a line change the range
        without one (a loaded machine left the Sweeps snapshot one row short for good). So a
        scroll that stopped short tries again on those too, until it lands or something else
        scrolls the table."""
        self._top_row = index
        self._scroll_top()

    def _scroll_top(self) -> None:
        assert self._top_row is not None
        self.scroll_to(y=self._top_row, animate=False, force=True, immediate=True)
        y = self.scroll_offset.y
        self._top_short = y if y < self._top_row else None

    def _range_changed(self) -> None:
        # Only where the short scroll left it: a user who scrolled since keeps their place.
        if self._top_row is not None and self._top_short is not None and self.scroll_offset.y == self._top_short:
            self._scroll_top()

    def _forget_top(self) -> None:
        self._top_row = self._top_short = None

    # The user scrolled (wheel, scrollbar): their place wins over the row to show first.
    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        self._forget_top()

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        self._forget_top()

    def on_scroll_up(self, message: ScrollUp) -> None:
        self._forget_top()

    def on_scroll_down(self, message: ScrollDown) -> None:
        self._forget_top()

    def on_scroll_to(self, message: ScrollTo) -> None:
        self._forget_top()

    def on_resize(self, event: events.Resize) -> None:
        if self._top_row is not None:
            self._scroll_top()

    def watch_show_horizontal_scrollbar(self) -> None:
        self._range_changed()  # set in the layout, with the range it leaves

    def watch_show_vertical_scrollbar(self, shown: bool) -> None:
        # Textual moves the thumb only on scrolls while the bar shows: one made before (a short
        # scroll's retry, rows set and scrolled before the layout) left it at the top.
        if shown:
            self.vertical_scrollbar.position = self.scroll_y

    def _scroll_to_cursor(self) -> None:
        self._forget_top()
        self.scroll_to_region(Region(0, self.cursor_row + 1, 1, 1), animate=False, spacing=Spacing(top=1),
                              force=True, immediate=True)

    def _page(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def action_cursor_up(self) -> None:
        self.move_cursor(row=self.cursor_row - 1)

    def action_cursor_down(self) -> None:
        self.move_cursor(row=self.cursor_row + 1)

    def action_page_up(self) -> None:
        self.move_cursor(row=self.cursor_row - self._page())

    def action_page_down(self) -> None:
        self.move_cursor(row=self.cursor_row + self._page())

    def action_first(self) -> None:
        self.move_cursor(row=0)

    def action_last(self) -> None:
        self.move_cursor(row=len(self._rows) - 1)

    def action_select_cursor(self) -> None:
        key = self.cursor_key
        if key is not None:
            self.post_message(self.RowSelected(self, self.cursor_row, key))

    def _on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        index = offset.y - 1 + self.scroll_offset.y
        if not 0 <= index < len(self._rows):
            return
        event.stop()
        again = index == self.cursor_row
        self.move_cursor(row=index)
        if again:
            self.action_select_cursor()

    def _on_focus(self, event: events.Focus) -> None:
        self._strips.clear()
        self.refresh()

    def _on_blur(self, event: events.Blur) -> None:
        self._strips.clear()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._strips.clear()
        self._look = None

    # -- drawing ---------------------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        self._now = self._styles_now()  # once per pass: the widget's style walks its ancestors
        return super().render_lines(crop)

    def _styles_now(self) -> tuple:
        """(base, header, even row, odd row, cursor, cursor post-style), per style generation."""
        key = (self.rich_style, self.has_focus, self.app.current_theme.name)
        if self._look is None or self._look[0] != key:
            base = key[0]
            cursor = self.get_component_rich_style("row-table--cursor")
            post = Style.from_color(cursor.color) + Style.from_color(bgcolor=cursor.bgcolor)
            self._look = (key, (base, self.get_component_styles("row-table--header").rich_style,
                                self.get_component_styles("row-table--even-row").rich_style,
                                self.get_component_styles("row-table--odd-row").rich_style, cursor, post))
            self._strips.clear()
        return self._look[1]

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        base, header, even, odd, cursor, post = self._now or self._styles_now()
        if y == 0:
            strip = self._strip(-1, header, Style(), Style(), self._labels, width)
        else:
            index = y - 1 + scroll_y
            if index >= len(self._rows):
                return Strip.blank(width, base)
            row_style = (odd if index % 2 else even) if self.zebra_stripes else base
            if index == self.cursor_row:
                strip = self._strip(index, row_style, cursor, post, self._rows[index][1], width)
            else:
                strip = self._strip(index, row_style, Style(), Style(), self._rows[index][1], width)
        return strip.crop_extend(scroll_x, scroll_x + width, base)

    def _edge(self) -> int:
        """The table's column (unscrolled) at the right edge of what is on screen."""
        return self.scroll_offset.x + self.scrollable_content_region.width

    def _strip(self, index: int, row_style: Style, cursor: Style, post: Style, cells: Sequence[Cell],
               width: int) -> Strip:
        """One full line of the table (not yet scrolled), cached until something it shows changes.
        A row's cell that runs past the right edge of the screen ends there at a word break with an
        ellipsis (a long INFO or NOTE read as cut mid-word); scrolled right, it shows more."""
        edge = self._edge() if index >= 0 else None
        key = (index, bool(cursor), max(width, sum(w + 2 * _PAD for w in self._widths)), edge)
        strip = self._strips.get(key)
        if strip is not None:
            return strip
        pre = row_style + cursor
        pad = pre + post
        segments: list[Segment] = []
        console = self.app.console
        x = 0
        for n, column_width in enumerate(self._widths):
            cell = cells[n] if n < len(cells) else ""
            start, x = x + _PAD, x + column_width + 2 * _PAD
            if edge is not None and start + MIN_CLIP <= edge < start + column_width:
                cell = clip_cell(cell, edge - start)
            segments.append(Segment(" " * _PAD, pad))
            if isinstance(cell, Text):
                # Text.render leaves the Text's own style out (only its spans come through)
                own = pre + console.get_style(cell.style, default=Style.null()) if cell.style else pre
                used = 0
                for seg in cell.render(console, end=""):
                    if seg.text:
                        segments.append(Segment(seg.text, own + seg.style + post if seg.style else own + post))
                        used += seg.cell_length
            else:
                text = str(cell)
                segments.append(Segment(text, pad))
                used = cell_len(text)
            segments.append(Segment(" " * (column_width - used + _PAD), pad))
        strip = Strip(segments).extend_cell_length(key[2], pad).simplify()
        self._strips[key] = strip
        return strip
