"""RowTable: what it draws, where its cursor goes, what it tells its owner."""

from __future__ import annotations

import pytest
from rich.text import Text
from textual.app import App, ComposeResult
from textual.scrollbar import ScrollTo

from ddtree.console.widgets.rowtable import RowTable

pytestmark = pytest.mark.timeout(60)


class TableApp(App):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[str, int, str]] = []

    def compose(self) -> ComposeResult:
        yield RowTable("ID", "NAME", "STATE", id="t")

    def on_row_table_row_selected(self, event: RowTable.RowSelected) -> None:
        self.messages.append(("selected", event.cursor_row, event.row_key))

    def on_row_table_row_highlighted(self, event: RowTable.RowHighlighted) -> None:
        self.messages.append(("highlighted", event.cursor_row, event.row_key))


def rows(n: int, *, state: str = "done") -> list[tuple[str, tuple]]:
    return [(str(i), (str(i), f"run-{i}", state)) for i in range(n)]


def line(table: RowTable, y: int) -> str:
    return table.render_line(y).text


async def test_draws_header_and_rows_in_columns_as_wide_as_their_widest_cell():
    app = TableApp()
    async with app.run_test(size=(60, 10)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows([("1", ("1", "short", "done")), ("2", ("2", "a-longer-name", Text("failed", style="red")))])
        await pilot.pause()
        assert line(table, 0).rstrip() == " ID  NAME           STATE"
        assert line(table, 1).rstrip() == " 1   short          done"
        assert line(table, 2).rstrip() == " 2   a-longer-name  failed"
        assert len(line(table, 1)) == table.size.width  # the row's style reaches the edge
        red = [seg for seg in table.render_line(2) if seg.text == "failed"]
        assert red and red[0].style.color.name == "red"
        assert line(table, 3).strip() == ""
        assert table.row_count == 2 and [str(c) for c in table.get_row_at(1)] == ["2", "a-longer-name", "failed"]


async def test_cursor_keeps_its_row_across_updates_and_clamps():
    app = TableApp()
    async with app.run_test(size=(60, 10)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows(rows(5))
        table.move_cursor(row=3)
        assert table.cursor_key == "3"
        table.set_rows(list(reversed(rows(5))))  # same rows, new order: the cursor follows row "3"
        assert table.cursor_row == 1 and table.cursor_key == "3"
        table.set_rows(rows(2))  # row "3" is gone: the cursor stays in range
        assert table.cursor_row <= 1 and table.cursor_key in ("0", "1")
        table.set_rows([])
        assert table.row_count == 0 and table.cursor_key is None
        await pilot.pause()


async def test_a_changed_cell_is_redrawn_and_the_rest_kept():
    app = TableApp()
    async with app.run_test(size=(60, 10)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows(rows(3, state="running"))
        await pilot.pause()
        before = line(table, 2)
        table.set_rows([*rows(3, state="running")[:2], ("2", ("2", "run-2", "done   "))])
        await pilot.pause()
        assert line(table, 2) == before  # row 1 untouched
        assert "done" in line(table, 3) and "running" not in line(table, 3)


async def test_keys_move_the_cursor_and_enter_or_a_second_click_selects():
    app = TableApp()
    async with app.run_test(size=(60, 8)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows(rows(30))
        table.focus()
        await pilot.press("down", "down")
        assert table.cursor_row == 2
        await pilot.press("end")
        assert table.cursor_row == 29
        assert table.scroll_offset.y > 0  # scrolled to keep the cursor in view
        await pilot.press("home", "pagedown")
        assert table.cursor_row > 2
        await pilot.press("home", "enter")
        assert app.messages[-1] == ("selected", 0, "0")
        app.messages.clear()
        await pilot.click(RowTable, offset=(3, 2))  # second row on screen: row 1
        assert table.cursor_row == 1 and ("highlighted", 1, "1") in app.messages
        assert not [m for m in app.messages if m[0] == "selected"]
        await pilot.click(RowTable, offset=(3, 2))
        assert app.messages[-1] == ("selected", 1, "1")
        await pilot.click(RowTable, offset=(3, 0))  # the header selects nothing
        assert app.messages[-1] == ("selected", 1, "1") and table.cursor_row == 1


async def test_wider_than_the_widget_scrolls_sideways():
    app = TableApp()
    async with app.run_test(size=(20, 6)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows([("1", ("1", "x" * 40, "done"))])
        table.focus()
        await pilot.pause()
        assert table.virtual_size.width > table.size.width
        assert line(table, 1).startswith(" 1   xxx")
        await pilot.press("right", "right", "right")
        assert table.scroll_offset.x == 3
        assert line(table, 1).startswith("  xxx") and line(table, 0).startswith("  NAME")


async def test_a_row_scrolled_to_the_top_stays_there_when_the_table_gets_shorter():
    """scroll_row_to_top before the layout shrinks the table: the scroll made first is clamped to
    the taller table's range, and the resize puts the row back on top; a cursor move ends it."""
    app = TableApp()
    async with app.run_test(size=(60, 12)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows(rows(14))
        await pilot.pause()
        table.scroll_row_to_top(7)
        assert table.scroll_offset.y == table.max_scroll_y < 7  # all 12 lines tall: clamped
        table.styles.max_height = 6  # the layout settles on a shorter table
        await pilot.pause()
        await pilot.pause()
        assert table.scroll_offset.y == 7 and "run-7" in line(table, 1)
        table.move_cursor(row=0)
        table.styles.max_height = 5
        await pilot.pause()
        await pilot.pause()
        assert table.scroll_offset.y == 0


class FixedTableApp(TableApp):
    """A table whose height does not follow its rows (as Sweeps' points table, 1fr): rows arriving
    or a scrollbar coming change its scroll range without a Resize."""

    def __init__(self, width: int = 60, height: int = 8) -> None:
        super().__init__()
        self.table_size = width, height

    def on_mount(self) -> None:
        table = self.query_one(RowTable)
        table.styles.width, table.styles.height = self.table_size


def wide_rows(n: int) -> list[tuple[str, tuple]]:
    return [(str(i), (str(i), f"run-{i}", "x" * 30)) for i in range(n)]


async def test_a_row_scrolled_to_the_top_before_the_rows_arrive_is_shown_once_they_do():
    app = FixedTableApp()
    async with app.run_test(size=(60, 12)) as pilot:
        table = app.query_one(RowTable)
        await pilot.pause()
        table.scroll_row_to_top(7)
        assert table.scroll_offset.y == 0  # nothing to scroll yet
        table.set_rows(rows(14))
        await pilot.pause()
        assert table.size.height == 8 and not table.show_horizontal_scrollbar
        assert table.scroll_offset.y == 7 and "run-7" in line(table, 1)
        assert table.vertical_scrollbar.position == 7


async def test_a_row_scrolled_to_the_top_before_a_horizontal_scrollbar_comes_is_shown_once_it_has():
    """Sweeps at 80x24 on a loaded box: the rows are set and the scroll made before the layout
    that adds the horizontal scrollbar, so the scroll stops one row short (the scrollbar's line is
    not counted yet); the table's size does not change, so no Resize put it right."""
    app = FixedTableApp(width=40, height=9)  # as at 80x24: a scrollbar line, the header, 7 rows
    async with app.run_test(size=(60, 12)) as pilot:
        table = app.query_one(RowTable)
        await pilot.pause()
        table.set_rows(wide_rows(14))
        table.scroll_row_to_top(7)
        assert table.scroll_offset.y == 6 and not table.show_horizontal_scrollbar  # clamped short
        await pilot.pause()
        await pilot.pause()
        assert table.show_horizontal_scrollbar
        assert table.scroll_offset.y == 7 and "run-7" in line(table, 1)
        assert table.vertical_scrollbar.position == 7  # the thumb too, though the bar came after the scroll


async def scrolled_short(app: FixedTableApp, pilot) -> RowTable:
    """Row 7 asked to show first in a table of 10 rows (11 lines in 8): the scroll stops at 3."""
    table = app.query_one(RowTable)
    table.set_rows(rows(10))
    await pilot.pause()
    table.scroll_row_to_top(7)
    assert table.scroll_offset.y == 3
    return table


async def test_a_short_scroll_to_the_top_row_leaves_a_user_who_scrolled_since_alone():
    app = FixedTableApp()
    async with app.run_test(size=(60, 12)) as pilot:
        table = await scrolled_short(app, pilot)
        table.scroll_to(y=1, animate=False)  # somewhere else than where the short scroll stopped
        table.set_rows(rows(14))
        await pilot.pause()
        assert table.scroll_offset.y == 1


def keyed(prefix: str, n: int) -> list[tuple[str, tuple]]:
    return [(f"{prefix}{i}", (str(i), f"{prefix}-{i}", "done")) for i in range(n)]


async def test_a_short_scroll_is_forgotten_when_other_rows_replace_the_table():
    """Sweeps switching runs: the old run's rows, then none, then the new run's. The new run
    opens at its top, not at the row the old run was to show first."""
    app = FixedTableApp()
    async with app.run_test(size=(60, 12)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows(keyed("a", 14))
        await pilot.pause()
        table.scroll_row_to_top(10)
        assert table.scroll_offset.y == 7  # 15 lines in 8: short
        table.set_rows([])
        await pilot.pause()
        table.set_rows(keyed("b", 30))
        await pilot.pause()
        assert table.scroll_offset.y == 0


async def test_a_short_scroll_is_forgotten_once_the_user_scrolls_even_back_to_where_it_stopped():
    app = FixedTableApp()
    async with app.run_test(size=(60, 12)) as pilot:
        table = await scrolled_short(app, pilot)
        table.post_message(ScrollTo(y=0, animate=False))  # the user drags the scrollbar up
        await pilot.pause()
        table.post_message(ScrollTo(y=3, animate=False))  # and back down to the end
        await pilot.pause()
        assert table.scroll_offset.y == 3
        table.set_rows(rows(14))
        await pilot.pause()
        assert table.scroll_offset.y == 3


async def test_a_cell_past_the_right_edge_ends_at_a_word_break_with_an_ellipsis():
    """A long last cell (the Overview's INFO, the Sweeps' NOTE) is cut at the screen's edge: it
    ends at a word break with '…' instead of mid-word; scrolled right, more of it shows."""
    from ddtree.console.widgets.rowtable import clip_cell

    app = TableApp()
    async with app.run_test(size=(30, 10)) as pilot:
        table = app.query_one(RowTable)
        table.set_rows([("1", ("1", "demo", "serving at http://127.0.0.1:40123")),
                        ("2", ("2", "demo", Text("engine died at start", style="red"))),
                        ("3", ("3", "demo", "ok"))])
        await pilot.pause()
        width = table.scrollable_content_region.width
        assert line(table, 0).rstrip() == " ID  NAME  STATE"  # the header is not clipped
        assert line(table, 1)[:width].rstrip() == " 1   demo  serving at…"
        assert line(table, 2)[:width].rstrip() == " 2   demo  engine died at…"
        red = [seg for seg in table.render_line(2) if seg.text.startswith("engine")]
        assert red and red[0].style.color.name == "red"  # the clipped cell keeps its style
        assert line(table, 3).rstrip() == " 3   demo  ok"
        assert [str(c) for c in table.get_row_at(0)][2] == "serving at http://127.0.0.1:40123"  # kept whole
        table.scroll_to(x=table.max_scroll_x, animate=False, immediate=True)
        await pilot.pause()
        assert "127.0.0.1:40123" in line(table, 1)
    # one word longer than the room: cut inside it, still with the ellipsis
    assert clip_cell("baseline", 6) == "basel…"
    assert clip_cell("busy box", 6) == "busy…"
    assert clip_cell("fits", 6) == "fits"
