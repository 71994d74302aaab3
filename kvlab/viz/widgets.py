"""Shared plumbing for widget panels: visible callback errors and in-place figure updates."""

from __future__ import annotations

import contextlib
import functools
import html
import traceback
from collections.abc import Callable, Iterator
from typing import Any

ERROR_CSS_CLASS = "kvlab-callback-error"


def error_area() -> Any:
    """An ``ipywidgets.Output`` where a panel's callback errors are shown to the learner."""
    import ipywidgets as w

    return w.Output(layout=w.Layout(width="auto"))


def guarded(callback: Callable[..., Any], errors: Any) -> Callable[..., Any]:
    """Wrap a widget callback so an exception shows in ``errors`` instead of vanishing.

    ipywidgets sends callback exceptions to the browser's log, where a learner never
    looks; here the traceback appears as a red box (CSS class ``kvlab-callback-error``,
    which the UI tests search for) and the panel keeps working. A successful call
    clears an earlier error.
    """

    @functools.wraps(callback)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = callback(*args, **kwargs)
        except Exception:
            from IPython.display import HTML

            # append_display_data works inside a kernel and outside one (tests) alike.
            errors.outputs = ()
            errors.append_display_data(
                HTML(
                    f'<pre class="{ERROR_CSS_CLASS}" style="color:#b42318;background:#fef3f2;'
                    f'padding:6px;white-space:pre-wrap">{html.escape(traceback.format_exc())}</pre>'
                )
            )
            return None
        errors.outputs = ()
        return result

    return wrapper


def figure_widget(figure: Any) -> Any:
    """A plotly ``FigureWidget`` for ``figure`` (needs anywidget, installed with kvlab)."""
    import plotly.graph_objects as go

    return go.FigureWidget(figure)


def replace_figure(target: Any, figure: Any) -> None:
    """Redraw ``target`` (a FigureWidget) in place with the traces and layout of ``figure``.

    Traces are updated in one ``batch_update`` when their number and kinds match (a cheap
    redraw while dragging), else replaced. Then ``keep_for_new_views``.
    """
    same_shape = len(target.data) == len(figure.data) and all(
        a.type == b.type for a, b in zip(target.data, figure.data, strict=True)
    )
    with target.batch_update():
        if same_shape:
            for old, new in zip(target.data, figure.data, strict=True):
                old.update(new.to_plotly_json(), overwrite=True)
        else:
            target.data = ()
            target.add_traces(list(figure.data))
        target.layout = figure.layout
    keep_for_new_views(target, figure)


def keep_for_new_views(target: Any, figure: Any) -> None:
    """Make ``figure`` (just drawn into ``target``) the figure that views created later start from.

    plotly sends an edit only to the views that exist, and keeps what a new view draws as it
    was when the FigureWidget was built: in Voila (which draws widgets after every cell ran)
    or after a page reload, a panel would show its first figure beside its current numbers.
    Call this after any in-place redraw that does not go through ``replace_figure``.
    """
    if hasattr(target, "_widget_data"):  # plotly >= 6 (anywidget)
        target._widget_data = [
            {**new.to_plotly_json(), "uid": old.uid} for old, new in zip(target.data, figure.data, strict=True)
        ]
        target._widget_layout = figure.layout.to_plotly_json()


class Panel:
    """What a control panel shares with the others: recompute on a change, several changes in one redraw, display.

    A subclass builds its controls, ``view`` and first ``state``, observes its controls with
    ``guarded(self._update, errors)``, and provides ``compute`` (the pure function behind the
    panel, called on the controls' values) and ``_render`` (the redraw).
    """

    state: dict[str, Any]
    view: Any
    errors: Any
    _holding = False

    def apply_preset(self, name: str) -> None:
        raise NotImplementedError

    def compute(self) -> dict[str, Any]:
        raise NotImplementedError

    def _render(self) -> None:
        raise NotImplementedError

    def _update(self, _change: Any = None) -> None:
        if self._holding:
            return
        self.state = self.compute()
        self._render()

    def _connect(self, controls: list[Any], preset_buttons: dict[str, Any], preset: str | None) -> None:
        """Observe ``controls`` and the preset buttons (errors shown in ``self.errors``), then show ``preset``."""
        update = guarded(self._update, self.errors)
        for control in controls:
            control.observe(update, names="value")
        for name, button in preset_buttons.items():
            button.on_click(guarded(lambda _b, name=name: self.apply_preset(name), self.errors))
        if preset is not None:
            self.apply_preset(preset)
        else:
            self._render()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Set several controls at once: one redraw at the end instead of one per control."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        self._update()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)
