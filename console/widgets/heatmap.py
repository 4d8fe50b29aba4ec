"""The acceptance heatmap: budgets down, accepted length per round across, each cell shaded by
the share of verify rounds that accepted that many tokens (store.insight.acceptance_grids).

Where a budget's row goes blank to the right is where extra nodes stop being accepted. Shades
are fixed bands of the share (not scaled to the largest cell), so two concurrencies, or two
runs, read alike. Pure functions: Rich Text for the console, Markdown lines for the md export.
"""

from __future__ import annotations

from rich.text import Text

from ddtree.store.insight import AcceptanceGrid, acceptance_grids

#: (lowest share, block, style), darkest first; a share of 0 is left blank.
SHADES = ((0.30, "█", "bold bright_cyan"), (0.15, "▓", "cyan"), (0.05, "▒", "dark_cyan"), (0.0, "░", "grey50"))
LEGEND = "░ <5%  ▒ 5-15%  ▓ 15-30%  █ ≥30% of rounds"
GAP = 3  # columns between grids laid side by side


def shade(share: float) -> tuple[str, str]:
    """(block, style) for a share of rounds; ("", "") for none."""
    if share <= 0:
        return " ", ""
    for low, block, style in SHADES:
        if share >= low:
            return block, style
    return SHADES[-1][1], SHADES[-1][2]


def _cell_width(grid: AcceptanceGrid, width: int) -> int:
    """2 columns per length when they fit (cells read as squares), else 1."""
    return 2 if _block_width(grid, 2) <= width else 1


def _label_width(grid: AcceptanceGrid) -> int:
    return max(6, *(len(r.label) for r in grid.rows))


def _block_width(grid: AcceptanceGrid, cell: int) -> int:
    return _label_width(grid) + 1 + cell * len(grid.lengths) + 6


def axis_marks(lengths, cell: int) -> str:
    """The length axis: each label right-aligned under its cell, left out where it would touch
    the label before it (so 9 10 11 12 never run together into 9101112)."""
    chars = [" "] * (cell * len(lengths))
    last_end = -2
    for n, length in enumerate(lengths):
        mark = str(length)
        end = (n + 1) * cell  # one past the cell's last column
        start = end - len(mark)
        if start >= 0 and start > last_end:
            chars[start:end] = mark
            last_end = end
    return "".join(chars)


def grid_lines(grid: AcceptanceGrid, width: int = 80) -> list[Text]:
    """One grid: a title, the length axis, a row per budget (its mean accepted length at the end:
    rounds only, so a little under the sweep's tau, which also counts each request's first
    token, made by its prefill), all one width."""
    cell = _cell_width(grid, width)
    lw = _label_width(grid)
    title = f"{grid.label or 'acceptance'}: accepted length per round"
    total = max(_block_width(grid, cell), len(title))
    lines = [Text(title, style="bold")]
    axis = Text("budget".rjust(lw) + " ", style="dim")
    axis.append(axis_marks(grid.lengths, cell), style="dim")
    axis.append("  mean", style="dim")
    lines.append(axis)
    for row in grid.rows:
        line = Text(row.label.rjust(lw) + " ", style="bold" if row.budget is not None else "gold3")
        for share in row.shares:
            block, style = shade(share)
            line.append(block * cell, style=style)
        line.append(f" {row.mean:5.2f}" if row.mean is not None else "     -", style="dim")
        lines.append(line)
    return [ln if ln.cell_len >= total else ln + Text(" " * (total - ln.cell_len)) for ln in lines]


def render_heatmap(points: list, width: int = 80, *, legend: bool = True) -> list[Text]:
    """The heatmaps of a run's points, one per setting (concurrency, TP ...), side by side as far
    as `width` allows, then below each other; [] when no point has a histogram."""
    grids = acceptance_grids(points)
    return render_grids(grids, width, legend=legend)


def render_grids(grids: list[AcceptanceGrid], width: int = 80, *, legend: bool = True) -> list[Text]:
    if not grids:
        return []
    blocks = [grid_lines(g, width) for g in grids]
    out: list[Text] = []
    row: list[list[Text]] = []
    used = 0
    for block in blocks:
        w = block[0].cell_len
        if row and used + GAP + w > width:
            out += _side_by_side(row)
            row, used = [], 0
        row.append(block)
        used += (GAP if used else 0) + w
    if row:
        out += _side_by_side(row)
    if legend:
        out.append(Text(LEGEND, style="dim"))
    return out


def _side_by_side(blocks: list[list[Text]]) -> list[Text]:
    height = max(len(b) for b in blocks)
    out = []
    for i in range(height):
        line = Text()
        for n, block in enumerate(blocks):
            if n:
                line.append(" " * GAP)
            part = block[i] if i < len(block) else Text(" " * block[0].cell_len)
            line.append_text(part)
        line.rstrip()
        out.append(line)
    return out


def heatmap_text(points: list, width: int = 80) -> Text:
    """The heatmaps as one Text (a Static's content), or a note when there is nothing to draw."""
    lines = render_heatmap(points, width)
    if not lines:
        return Text("no acceptance histogram yet: DDTree and DFlash points record one as they finish", style="dim")
    return Text("\n").join(lines)


def heatmap_markdown(points: list) -> list[str]:
    """Markdown for the md export: per setting a table of budgets by accepted length, each cell
    the share of rounds with its block; [] when no point has a histogram."""
    grids = acceptance_grids(points)
    if not grids:
        return []
    out = ["## Acceptance per round", "",
           "Share of verify rounds that accepted each length (bonus token included), per budget, and "
           "its mean: over rounds only, so a little under the points' tau (weighted by verify), "
           "which also counts each request's first token, made by its prefill, as SGLang's accept "
           f"length does. Shades: {LEGEND}.", ""]
    for grid in grids:
        out.append(f"### {grid.label or 'all points'}")
        out.append("")
        out.append("| budget | " + " | ".join(str(n) for n in grid.lengths) + " | mean | rounds |")
        out.append("|---|" + "---:|" * len(grid.lengths) + "---:|---:|")
        for row in grid.rows:
            cells = []
            for share in row.shares:
                block, _ = shade(share)
                cells.append(f"{block} {share * 100:.0f}%" if share > 0 else "")
            mean = f"{row.mean:.2f}" if row.mean is not None else "-"
            out.append(f"| {row.label} | " + " | ".join(cells) + f" | {mean} | {row.rounds} |")
        out.append("")
    return out
