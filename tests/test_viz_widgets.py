"""Panel plumbing: a FigureWidget redrawn by ``replace_figure`` starts new views from the current figure."""

import plotly.graph_objects as go
import pytest

from kvlab.viz.widgets import figure_widget, replace_figure


def _line(name: str, y: list[float], title: str) -> go.Figure:
    return go.Figure(go.Scatter(x=list(range(len(y))), y=y, name=name), layout=dict(title=title))


@pytest.mark.parametrize("second", [
    _line("after", [3.0, 2.0, 1.0], "second"),                                      # same shape: updated in place
    go.Figure([go.Bar(x=[1], y=[2], name="a"), go.Bar(x=[1], y=[3], name="b")],  # new shape: replaced
              layout=dict(title="second")),
])
def test_a_view_created_after_a_redraw_shows_the_redrawn_figure(second):
    """What Voilà and a reloaded page draw (``_widget_data``/``_widget_layout``) is the latest figure, not the first."""
    fw = figure_widget(_line("before", [1.0, 2.0, 3.0], "first"))
    replace_figure(fw, second)
    assert [t["name"] for t in fw._widget_data] == [t.name for t in second.data]
    assert [list(t["y"]) for t in fw._widget_data] == [list(t.y) for t in second.data]
    assert [t["uid"] for t in fw._widget_data] == [t.uid for t in fw.data]  # later edits still find their trace
    assert fw._widget_layout["title"]["text"] == "second"
    assert [t.name for t in fw.data] == [t.name for t in second.data]
