"""Charts start their y-axis near the data, use their height, and keep the whole legend."""

from __future__ import annotations

from ddtree.console.widgets.chart import LineChart, Series, _label_rows, y_range


def test_the_y_axis_hugs_the_data_instead_of_starting_at_zero():
    assert y_range([3.1, 3.6, 4.0, 4.3, 4.5]) == (2.5, 5.0)  # tau: the curve fills the plot
    assert y_range([61.0, 68.0, 74.0, 77.5, 71.0]) == (55.0, 80.0)
    lo, hi = y_range([0.05, 3.0])
    assert lo == 0.0 and hi >= 3.0  # near zero anyway: it starts at zero, never below
    lo, hi = y_range([100.0])
    assert lo < 100.0 < hi  # one value still gets a span
    assert y_range([-3.0, 5.0])[0] < -3.0


def test_labels_top_bottom_and_evenly_between():
    assert _label_rows(13) == [0, 3, 6, 9, 12]
    assert _label_rows(5) == [0, 2, 4]
    assert _label_rows(1) == [0]


async def test_a_narrow_chart_wraps_its_legend_and_uses_its_height():
    from textual.app import App

    chart = LineChart("tok/s", x_label="budget")

    class One(App):
        def compose(self):
            yield chart

    async with One().run_test(size=(30, 20)) as pilot:
        series = [Series("c=1", ((4, 61.0), (8, 68.0), (16, 74.0)), best=(16, 74.0)),
                  Series("c=4", ((4, 150.0), (8, 160.0), (16, 170.0)), color="green3"),
                  Series("AR", ((0, 22.0),), reference=True), Series("DFlash", ((0, 55.0),), reference=True)]
        chart.set_series(series)
        await pilot.pause()
        lines = chart.as_text().plain.split("\n")
        assert len(lines) == 20  # every row of the widget
        legend = " ".join(lines[-3:])
        for name in ("c=1", "c=4", "AR", "DFlash", "best"):
            assert name in legend
        plot = [line for line in lines if "│" in line]
        assert len(plot) == 20 - 2 - (len(lines) - 2 - len(plot))  # title, x ticks, legend: the rest is plot
        assert len(plot) >= 14
        assert plot[0].split("│")[0].strip() == "200" and plot[-1].split("│")[0].strip() == "0"
        chart.set_series(series[:2])  # without the baselines the axis starts near 61, not at 0
        await pilot.pause()
        plot = [line for line in chart.as_text().plain.split("\n") if "│" in line]
        assert float(plot[-1].split("│")[0]) == y_range([61.0, 68.0, 74.0, 150.0, 160.0, 170.0])[0] > 0
