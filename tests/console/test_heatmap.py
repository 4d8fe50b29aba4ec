"""The acceptance heatmap drawn from known histograms: blocks by share, axis, layout at 80 columns."""

from ddtree.console.widgets.heatmap import (axis_marks, heatmap_markdown, heatmap_text, render_heatmap, shade)

from ..store.insight_support import point


def _plain(lines) -> list[str]:
    return [line.plain for line in lines]


def test_cells_are_shaded_by_share_of_rounds():
    # budget 8: half the rounds accept 1, half 2; budget 32: 10% 1, 20% 2, 30% 3, 40% 4 (of 10)
    pts = [point("ddtree", 8, 0, 90, hist=[0, 5, 5]), point("ddtree", 32, 0, 99, hist=[0, 1, 2, 3, 4]),
           point("ar", None, 0, 50)]
    lines = _plain(render_heatmap(pts, 80))
    assert lines[0].startswith("c=1: accepted length per round")
    assert lines[1].split() == ["budget", "1", "2", "3", "4", "mean"]
    row8 = next(ln for ln in lines if ln.lstrip().startswith("8 "))
    row32 = next(ln for ln in lines if ln.lstrip().startswith("32 "))
    assert row8.split()[1:] == ["████", "1.50"]  # two cells of 50%, then nothing: blank to the right
    assert "▒▒▓▓████" in row32 and row32.rstrip().endswith("3.00")
    assert lines[-1].startswith("░ <5%")
    assert shade(0) == (" ", "") and shade(0.01)[0] == "░" and shade(0.05)[0] == "▒" and shade(0.3)[0] == "█"


def test_each_concurrency_gets_a_grid_and_all_fit_80_columns():
    pts = []
    for c in (1, 4, 8):
        for b in (4, 8, 16, 32, 64, 128):
            pts.append(point("ddtree", b, 0, 100, concurrency=c, hist=[0] + [1] * 16))
        pts.append(point("dflash", None, 0, 80, concurrency=c, hist=[0, 3, 2, 1]))
    lines = render_heatmap(pts, 80)
    titles = [ln.plain for ln in lines if "accepted length per round" in ln.plain]
    assert [t.split(":")[0] for t in titles] == ["c=1", "c=4", "c=8"]
    assert all(ln.cell_len <= 80 for ln in lines)
    assert any(ln.plain.lstrip().startswith("DFlash") for ln in lines)


def test_narrow_grids_sit_side_by_side():
    pts = [point("ddtree", 8, 0, 90, hist=[0, 1, 1], concurrency=c) for c in (1, 2)]
    lines = _plain(render_heatmap(pts, 80, legend=False))
    assert len(lines) == 3 and "c=1:" in lines[0] and "c=2:" in lines[0]


def test_axis_labels_never_run_together():
    assert axis_marks(range(1, 5), 2) == " 1 2 3 4"
    marks = axis_marks(range(8, 13), 2)
    assert "910" not in marks and "1011" not in marks and marks.split()[0] == "8"


def test_no_histogram_reads_as_a_note_and_markdown_is_a_table():
    assert "no acceptance histogram" in heatmap_text([point("ddtree", 8, 0, 90)]).plain
    assert heatmap_markdown([point("ddtree", 8, 0, 90)]) == []
    md = heatmap_markdown([point("ddtree", 8, 0, 90, hist=[0, 1, 3])])
    assert "| budget | 1 | 2 | mean | rounds |" in md
    assert "| 8 | ▓ 25% | █ 75% | 1.75 | 4 |" in md
