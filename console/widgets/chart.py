"""A line chart drawn with braille dots on Textual's own primitives (no plotting dependency).

Each cell holds a 2x4 braille dot grid, so a 40x10 plot area has 80x40 dots. Series are drawn as
straight segments between their points, with a glyph at each measured point; reference series are
dotted horizontal lines (the AR and DFlash baselines); a series may carry error bars (min..max of
repeats) and a marked point (the best budget). `set_series` redraws only when the data changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.text import Text
from textual.geometry import Region
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

#: Colours that read on both dark and light backgrounds, in series order.
COLORS = ("dodger_blue2", "dark_orange", "green3", "magenta3", "red3", "dark_cyan", "gold3", "purple")

# Braille dot bit for (column 0-1, row 0-3) inside one cell.
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
_Y_LABEL_W = 7


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[tuple[float, float], ...]
    color: str = COLORS[0]
    #: (x, low, high) whiskers, e.g. the spread of repeats.
    errors: tuple[tuple[float, float, float], ...] = ()
    #: A horizontal dotted line at points[0]'s y across the whole x range.
    reference: bool = False
    #: A point to mark (the best budget of the series).
    best: tuple[float, float] | None = None


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 10000:
        return str(int(value))
    magnitude = abs(value)
    if magnitude >= 10000:
        return f"{value / 1000:.0f}k"
    if magnitude >= 1000:
        return f"{value / 1000:.1f}k"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def nice_step(span: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) near span / 8, to round the axis ends to."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / 8
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def y_range(values: list[float]) -> tuple[float, float]:
    """The y-axis for these values: near the data, not from 0 (a tau of 3.1 to 4.5 fills the
    plot instead of its top third), padded a tenth of the span each way and rounded out to a round
    step; never below 0 for data that are not."""
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    span = hi - lo
    if span == 0:
        span = abs(hi) * 0.2 or 1.0
    pad = span * 0.1
    step = nice_step(span + 2 * pad)
    y0 = math.floor((lo - pad) / step) * step
    y1 = math.ceil((hi + pad) / step) * step
    if lo >= 0:
        y0 = max(0.0, y0)
    return float(y0), float(y1)


def _label_rows(rows: int) -> list[int]:
    """Rows that get a y label: top and bottom, and between them evenly spaced rows at least three
    apart (a tall chart gets more than three labels; an even split keeps their values round)."""
    if rows <= 1:
        return [0]
    last = rows - 1
    for parts in (5, 4, 3, 2):
        if last % parts == 0 and last // parts >= 3:
            return [last * i // parts for i in range(parts + 1)]
    return [0, last // 2, last] if last >= 4 else [0, last]


class Canvas:
    """A braille dot grid of `cols` x `rows` cells with a colour per cell."""

    def __init__(self, cols: int, rows: int) -> None:
        self.cols, self.rows = max(1, cols), max(1, rows)
        self.bits = [[0] * self.cols for _ in range(self.rows)]
        self.color: list[list[str | None]] = [[None] * self.cols for _ in range(self.rows)]
        self.glyph: list[list[tuple[str, str] | None]] = [[None] * self.cols for _ in range(self.rows)]

    @property
    def width(self) -> int:
        return self.cols * 2

    @property
    def height(self) -> int:
        return self.rows * 4

    def dot(self, x: int, y: int, color: str) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            row, col = y // 4, x // 2
            self.bits[row][col] |= _DOTS[x % 2][y % 4]
            self.color[row][col] = color

    def line(self, x0: int, y0: int, x1: int, y1: int, color: str, *, every: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, step = dx + dy, 0
        while True:
            if step % every == 0:
                self.dot(x0, y0, color)
            step += 1
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def mark(self, x: int, y: int, char: str, style: str) -> None:
        row, col = y // 4, x // 2
        if 0 <= row < self.rows and 0 <= col < self.cols:
            self.glyph[row][col] = (char, style)

    def row_text(self, row: int) -> Text:
        # One span per run of cells in the same style, not one per cell: the spans are what
        # drawing the chart costs.
        out = Text()
        run: list[str] = []
        run_style = ""
        bits, colors, glyphs = self.bits[row], self.color[row], self.glyph[row]
        for col in range(self.cols):
            glyph = glyphs[col]
            if glyph is not None:
                char, style = glyph
            elif bits[col]:
                char, style = chr(0x2800 + bits[col]), colors[col] or ""
            else:
                char, style = " ", ""
            if style != run_style and run:
                out.append("".join(run), style=run_style or None)
                run = []
            run_style = style
            run.append(char)
        if run:
            out.append("".join(run), style=run_style or None)
        return out


class LineChart(Widget):
    """y against x for a few series; x may be log2-scaled (node budgets are powers of two)."""

    DEFAULT_CSS = """
    LineChart {
        height: 1fr;
        min-height: 6;
        padding: 0 1 0 0;
    }
    """

    series: reactive[tuple[Series, ...]] = reactive((), layout=False)
    """What is drawn; assign through `set_series` so an unchanged set does not redraw."""

    def __init__(self, title: str = "", *, x_label: str = "", log_x: bool = True, empty: str = "no data yet",
                 name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._drawn: tuple | None = None
        self.title = title
        self.x_label = x_label
        self.log_x = log_x
        self.empty = empty

    def set_series(self, series: list[Series] | tuple[Series, ...]) -> bool:
        """Show `series`; returns whether anything changed (and so was redrawn)."""
        series = tuple(series)
        if series == self.series:
            return False
        self.series = series
        return True

    def set_empty(self, text: str) -> None:
        if text != self.empty:
            self.empty = text
            self.refresh()

    # -- geometry ---------------------------------------------------------------------------
    def _xs(self) -> list[float]:
        return sorted({x for s in self.series if not s.reference for x, _ in s.points})

    def _tx(self, x: float) -> float:
        return math.log2(x) if self.log_x and x > 0 else x

    def _ranges(self) -> tuple[float, float, float, float]:
        xs = [self._tx(x) for x in self._xs()]
        ys = [y for s in self.series for _, y in s.points]
        ys += [v for s in self.series for _, lo, hi in s.errors for v in (lo, hi)]
        x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        y0, y1 = y_range(ys)
        return x0, x1, y0, y1

    def render_lines(self, crop: Region) -> list[Strip]:
        # Drawn once per size, data and style, then served from the cache: Textual asks again for
        # every full refresh of the screen (opening a comparison asks twice before it shows).
        width = self.size.width
        base = self.rich_style
        key = (self.size, self.series, self.title, self.x_label, self.empty, base)
        if self._drawn is None or self._drawn[0] != key:
            console = self.app.console
            lines = self.as_text().split("\n", allow_blank=True)
            self._drawn = (key, [Strip(list(line.render(console)), line.cell_len).apply_style(base)
                                 .crop_extend(0, width, base) for line in lines], Strip.blank(width, base))
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        _, strips, blank = self._drawn
        return strips[y] if y < len(strips) else blank

    def as_text(self) -> Text:
        """The chart at the widget's size, as text."""
        width, height = self.size.width, self.size.height
        title = Text(self.title, style="bold")
        drawable = [s for s in self.series if s.points]
        if width < _Y_LABEL_W + 6 or height < 4:
            return title
        if not any(not s.reference for s in drawable):
            # broken between words at the chart's width: cut at its edge, "point" read as "poi"
            note = Text(self.empty, style="dim italic").wrap(self.app.console, width)
            return Text.assemble(title, "\n", Text("\n").join(note))
        legend = self._legend(drawable, width)
        rows = height - 2 - len(legend)
        cols = width - _Y_LABEL_W - 1
        canvas = Canvas(cols, rows)
        x0, x1, y0, y1 = self._ranges()

        def px(x: float) -> int:
            return round((self._tx(x) - x0) / (x1 - x0) * (canvas.width - 1))

        def py(y: float) -> int:
            return round((y1 - y) / (y1 - y0) * (canvas.height - 1))

        for s in drawable:
            if s.reference:
                y = py(s.points[0][1])
                canvas.line(0, y, canvas.width - 1, y, s.color, every=3)
        for s in drawable:
            if s.reference:
                continue
            pts = sorted(s.points)
            for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
                canvas.line(px(xa), py(ya), px(xb), py(yb), s.color)
            for x, lo, hi in s.errors:
                canvas.line(px(x), py(lo), px(x), py(hi), s.color)
            for x, y in pts:
                canvas.mark(px(x), py(y), "•", s.color)
        for s in drawable:
            if s.best is not None and not s.reference:
                canvas.mark(px(s.best[0]), py(s.best[1]), "★", f"bold {s.color}")

        out = Text()
        out.append_text(title)
        if self.x_label:
            out.append(f" vs {self.x_label}", style="dim")
        out.append("\n")
        label_rows = {r: y1 - (y1 - y0) * r / max(1, rows - 1) for r in _label_rows(rows)}
        for row in range(rows):
            label = _fmt(label_rows[row]) if row in label_rows else ""
            out.append(label.rjust(_Y_LABEL_W - 1)[: _Y_LABEL_W - 1] + "│", style="dim")
            out.append_text(canvas.row_text(row))
            out.append("\n")
        out.append(self._x_ticks(cols, px), style="dim")
        for line in legend:
            out.append("\n")
            out.append_text(line)
        return out

    def _x_ticks(self, cols: int, px) -> str:
        line = [" "] * cols
        taken = -1
        for x in self._xs():
            label = _fmt(x)
            col = px(x) // 2
            start = min(max(0, col - len(label) // 2), cols - len(label))
            if start <= taken:
                continue
            line[start:start + len(label)] = list(label)
            taken = start + len(label)
        return " " * _Y_LABEL_W + "".join(line)

    @staticmethod
    def _legend(series: list[Series], width: int) -> list[Text]:
        """The legend, on as many lines as it needs at this width (at most 3): a legend cut off
        leaves a line nobody can name."""
        items = []
        for s in series:
            item = Text()
            item.append("┄ " if s.reference else "─ ", style=s.color)
            item.append(s.label)
            items.append(item)
        if any(s.best is not None for s in series):
            items.append(Text("★ best", style="bold"))
        lines = [Text(no_wrap=True, overflow="ellipsis")]
        for item in items:
            line = lines[-1]
            if line.cell_len and line.cell_len + 2 + item.cell_len > width and len(lines) < 3:
                lines.append(Text(no_wrap=True, overflow="ellipsis"))
                line = lines[-1]
            if line.cell_len:
                line.append("  ")
            line.append_text(item)
        for line in lines:
            line.truncate(width)
        return lines

    def watch_series(self) -> None:
        self.refresh()
