"""Charts drawn with plotly: one figure per chart, one subplot column per run (shared y axis),
the same colour for the same series name in every column."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from rl.dashboard.charts import MARKERS_UP_TO, OVERALL, Chart, Plot, series_colours

HEIGHT = 340


def _title(run: str, plot: Plot, columns: int) -> str:
    parts = ([run] if columns > 1 else []) + ([plot.caption] if plot.caption else [])
    return " · ".join(parts)


def figure(chart: Chart) -> go.Figure:
    runs = list(chart.plots)
    cols = max(len(runs), 1)
    titles = [_title(run, chart.plots[run], cols) for run in runs]
    # plotly.js's own look ("none"): a named template would be deep-copied into every figure
    fig = make_subplots(rows=1, cols=cols, shared_yaxes=True, horizontal_spacing=0.05 if cols > 1 else 0.0,
                        subplot_titles=titles if any(titles) else None, figure=go.Figure(layout={"template": "none"}))
    colour = series_colours(chart)
    in_legend: set[str] = set()
    for col, run in enumerate(runs, start=1):
        plot = chart.plots[run]
        for line in plot.lines:
            fig.add_trace(go.Scatter(
                x=line.x, y=line.y, name=line.name, legendgroup=line.name,
                mode="lines+markers" if line.mode == "lines" and len(line.x) <= MARKERS_UP_TO else line.mode,
                showlegend=line.name not in in_legend, text=line.labels, textposition="top center",
                stackgroup=f"stack{col}" if line.stack else None,
                line={"color": colour[line.name], "width": 3 if line.name == OVERALL else 2},
                marker={"color": colour[line.name], "size": 8 if line.labels else 5},
                cliponaxis=not line.labels), row=1, col=col)
            in_legend.add(line.name)
        if plot.heatmap is not None:
            fig.add_trace(go.Heatmap(z=plot.heatmap.z, x=plot.heatmap.x, y=plot.heatmap.y, coloraxis="coloraxis",
                                     name=run), row=1, col=col)
        axis = "" if col == 1 else str(col)
        left, right = fig.layout[f"xaxis{axis}"].domain
        middle = (left + right) / 2
        if not plot.has_data:
            fig.update_xaxes(visible=False, row=1, col=col)
            fig.add_annotation(text="no data yet", xref="paper", yref="paper", x=middle, y=0.55, showarrow=False,
                               font={"size": 16, "color": "#888"})
        if plot.missing:
            note = ("waiting for: " if not plot.has_data else "no data yet: ") + ", ".join(plot.missing)
            fig.add_annotation(text=note, xref="paper", yref="paper", x=middle if not plot.has_data else left,
                               y=0.42 if not plot.has_data else 1.0, xanchor="center" if not plot.has_data else "left",
                               yanchor="top", showarrow=False, font={"size": 10, "color": "#999"})
        fig.update_xaxes(title={"text": chart.x_label, "standoff": 4}, row=1, col=col)
    fig.update_yaxes(title_text=chart.y_label, row=1, col=1)
    if chart.y_range is not None:
        fig.update_yaxes(range=list(chart.y_range))
    if not chart.has_data:
        fig.update_yaxes(visible=False)
    fig.update_layout(title={"text": chart.title, "font": {"size": 14}}, height=HEIGHT,
                      margin={"l": 55, "r": 20, "t": 70, "b": 78}, uirevision=chart.id,
                      legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0},
                      coloraxis={"colorscale": "Viridis"})
    return fig


def figure_json(chart: Chart) -> dict[str, Any]:
    """The figure as plotly.js takes it (`Plotly.react(div, data, layout)`)."""
    return figure(chart).to_plotly_json()
