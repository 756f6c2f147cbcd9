"""The views' vocabulary: charts (lines, heatmaps, one plot per run), tables and panels, described
without a drawing library; `plotly_render` draws them in the browser and `report` with matplotlib."""
from __future__ import annotations

from dataclasses import dataclass, field

MARKERS_UP_TO = 40  # a series this short gets point markers too (one point alone draws no line)
OVERALL = "all"  # the series aggregating a chart's others, drawn in black
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5"]


@dataclass
class Line:
    name: str
    x: list[float]
    y: list[float]
    mode: str = "lines"  # plotly's scatter modes: "lines", "markers", "lines+markers+text"
    stack: bool = False  # stacked area with the plot's other stacked lines
    labels: list[str] | None = None  # a text beside each point


@dataclass
class Heatmap:
    z: list[list[float]]
    x: list[int]
    y: list[str]


@dataclass
class Plot:
    """One run's part of a chart; `missing` names the expected metrics with no data yet."""
    lines: list[Line] = field(default_factory=list)
    heatmap: Heatmap | None = None
    missing: list[str] = field(default_factory=list)
    caption: str = ""

    @property
    def has_data(self) -> bool:
        return bool(self.lines) or self.heatmap is not None


@dataclass
class Chart:
    id: str
    title: str
    x_label: str
    y_label: str
    plots: dict[str, Plot]  # run name -> its plot, in the order the runs were given
    y_range: tuple[float, float] | None = None

    @property
    def has_data(self) -> bool:
        return any(p.has_data for p in self.plots.values())


@dataclass
class Table:
    id: str
    title: str
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Panel:
    id: str
    title: str
    charts: list[Chart] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


def series_colours(chart: Chart) -> dict[str, str]:
    """One colour per series name, the same in every run's plot and in both renderers."""
    names = list(dict.fromkeys(line.name for plot in chart.plots.values() for line in plot.lines))
    others = [n for n in names if n != OVERALL]
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(others)}
    return {**colours, OVERALL: "#222222"} if OVERALL in names else colours


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
