"""Notebook 04's stepper: one request's life through the block pool and the free queue, drawn as notebook 03 draws.

A thin view over ``kvlab.sim.lifecycle``, which runs the story on a real ``KVCacheManager``;
each step is drawn by ``kvlab.viz.block_pool.figure_pool``, cached blocks with their hashes.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvlab.sim.block_scenarios import Step
from kvlab.sim.lifecycle import EVENTS, lifecycle_step_at, lifecycle_steps
from kvlab.viz.block_pool import assign_colours, figure_pool, shelves_needed
from kvlab.viz.step_panels import StepPanel

TITLE = "A request's life in the block pool"


def figure_lifecycle_step(step: Step, caption: bool = True, tokens: str = "words") -> go.Figure:
    """The picture after ``step.index`` events of the lifecycle, one height for every step."""
    steps = lifecycle_steps()
    return figure_pool(step.snapshot, f"{TITLE} · step {step.index} of {step.total}", step.text if caption else "",
                       shelves=max(shelves_needed(s.snapshot) for s in steps), colours=assign_colours(steps),
                       tokens=tokens, copy_key=False)


def lifecycle_state(index: int, tokens: str = "words") -> dict[str, Any]:
    """What the stepper shows after ``index`` events: replayed from a fresh manager, then drawn."""
    step = lifecycle_step_at(index)
    return {"step": step, "index": step.index, "total": step.total, "text": step.text, "snapshot": step.snapshot,
            "tokens": tokens, "figure": figure_lifecycle_step(step, caption=False, tokens=tokens)}


class LifecyclePanel(StepPanel):
    """Back / next / reset through ``kvlab.sim.lifecycle.EVENTS``: allocate, hit, free, evict."""

    def __init__(self) -> None:
        self.events = EVENTS
        self._build()

    def state_at(self, index: int) -> dict[str, Any]:
        """``lifecycle_state`` with the token display chosen."""
        return lifecycle_state(index, self.tokens.value)
