"""Step-through panels: back / next / reset over recorded steps, the step's text and its picture.

``StepPanel`` holds what they share; ``BlockPoolPanel`` steps through notebook 03's scenarios
(``kvlab.sim.block_scenarios``) and ``kvlab.viz.lifecycle.LifecyclePanel`` through notebook
04's request lifecycle. Every redraw is a replay from a fresh pool (``step_at``), so going back
is never an undo.
"""

from __future__ import annotations

import html
from typing import Any

from kvlab.sim.block_scenarios import SCENARIOS, get_scenario, step_at
from kvlab.viz.block_pool import figure_step
from kvlab.viz.widgets import error_area, figure_widget, guarded, replace_figure
from kvlab.viz.words import TOKEN_MODES


def panel_state(scenario: str, seed: int, index: int, tokens: str = "words") -> dict[str, Any]:
    """What the panel shows at step ``index`` of a named scenario: replayed from a fresh pool, then drawn."""
    chosen = get_scenario(scenario, seed)
    step = step_at(chosen, index)
    return {"scenario": chosen, "step": step, "index": step.index, "total": step.total, "text": step.text,
            "snapshot": step.snapshot, "tokens": tokens, "figure": figure_step(chosen, step, False, tokens)}


class StepPanel:
    """Back / next / reset over a list of steps, a words-or-ids toggle, the step's text and its picture.

    A subclass gives ``state_at(index)`` (a dict with "index", "total", "text" and "figure")
    and may add controls in ``extra_controls``. ``next()``, ``back()`` and ``reset()`` are what
    the buttons call; ``state`` holds the current step, so a notebook can drive the panel and
    assert on it.
    """

    extra_controls: tuple[Any, ...] = ()

    def _build(self) -> None:
        import ipywidgets as w

        self.back_button = w.Button(description="◀ back", layout=w.Layout(width="90px"))
        self.next_button = w.Button(description="next ▶", button_style="primary", layout=w.Layout(width="90px"))
        self.reset_button = w.Button(description="reset", layout=w.Layout(width="70px"))
        self.tokens = w.ToggleButtons(options=list(TOKEN_MODES), value="words", description="tokens",
                                      style={"button_width": "64px", "description_width": "50px"})
        self.text = w.HTML(layout=w.Layout(width="auto"))
        self.errors = error_area()
        self.state: dict[str, Any] = self.state_at(0)
        self.figure = figure_widget(self.state["figure"])
        self.next_button.on_click(guarded(lambda _: self.next(), self.errors))
        self.back_button.on_click(guarded(lambda _: self.back(), self.errors))
        self.reset_button.on_click(guarded(lambda _: self.reset(), self.errors))
        self.tokens.observe(guarded(lambda _: self.go_to(self.state["index"]), self.errors), names="value")
        self._show()
        row = w.HBox([self.back_button, self.next_button, self.reset_button, *self.extra_controls],
                     layout=w.Layout(flex_flow="row wrap", align_items="center"))
        self.view = w.VBox([row, self.tokens, self.errors, self.text, self.figure])

    def state_at(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def next(self) -> None:
        """One operation forward (stays on the last step)."""
        self.go_to(min(self.state["index"] + 1, self.state["total"]))

    def back(self) -> None:
        """One operation back: a replay of the operations before it, from a fresh pool."""
        self.go_to(max(self.state["index"] - 1, 0))

    def reset(self) -> None:
        """Back to the fresh pool."""
        self.go_to(0)

    def go_to(self, index: int) -> None:
        """Show the state after ``index`` operations."""
        self.state = self.state_at(index)
        self._show()
        replace_figure(self.figure, self.state["figure"])

    def _show(self) -> None:
        index, total = self.state["index"], self.state["total"]
        self.back_button.disabled = index == 0
        self.next_button.disabled = index == total
        self.text.value = (
            f"<div style='font-size:15px;line-height:1.4'><b>Step {index} of {total}</b> · "
            f"{html.escape(self.state['text'])}</div>"
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)


class BlockPoolPanel(StepPanel):
    """Step through a scenario of notebook 03: a scenario picker and a seed for the random workload."""

    def __init__(self, scenario: str = "walk 1: fork and copy-on-write", seed: int = 0) -> None:
        import ipywidgets as w

        self.scenario = w.Dropdown(options=list(SCENARIOS), value=scenario, description="scenario",
                                   layout=w.Layout(width="340px"), style={"description_width": "64px"})
        self.seed = w.BoundedIntText(value=seed, min=0, max=10**6, description="seed", layout=w.Layout(width="140px"),
                                     style={"description_width": "40px"})
        self.extra_controls = (self.scenario, self.seed)
        self._build()
        self.scenario.observe(guarded(lambda _: self.reset(), self.errors), names="value")
        self.seed.observe(guarded(lambda _: self.reset(), self.errors), names="value")

    def state_at(self, index: int) -> dict[str, Any]:
        """``panel_state`` at the chosen scenario, seed and token display."""
        return panel_state(self.scenario.value, self.seed.value, index, self.tokens.value)

    def _show(self) -> None:
        super()._show()
        self.seed.disabled = self.scenario.value != "random workload"
