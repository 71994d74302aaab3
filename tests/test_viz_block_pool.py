"""Notebook 03's picture and step-through panel: thin views over the recorded scenarios."""

import pytest

import kvlab.viz.block_pool as viz
from kvlab.sim.block_scenarios import SCENARIOS, get_scenario, record, step_at, walk_fork, walk_free_queue
from kvlab.viz.block_pool import BlockPoolPanel, assign_colours, figure_pool, figure_step


def hover(fig, part):
    (trace,) = [t for t in fig.data if t.name == part]
    return list(trace.hovertext)


def test_figure_draws_every_block_every_table_entry_and_the_queue_in_order():
    scenario = walk_free_queue()
    step = record(scenario)[3]  # A released: queue 2, 3, 4, 5, 1*, 0*
    fig = figure_step(scenario, step)
    assert len(hover(fig, "pool")) == 6 and hover(fig, "tables") == []
    assert [t.split(":")[0] for t in hover(fig, "queue")] == [f"queue position {i}" for i in range(6)]
    assert "block 1: cached" in hover(fig, "queue")[4]
    texts = [a.text for a in fig.layout.annotations]
    assert "<b>1</b>*" in texts and "<b>0</b>*" in texts and "step 3 of 4" in texts[-1]


def test_arrows_go_from_each_table_entry_to_its_physical_block():
    step = record(walk_fork())[3]  # A [0, 1], B [0, 2]
    fig = figure_pool(step.snapshot)
    arrows = [a for a in fig.layout.annotations if a.showarrow]
    assert len(arrows) == 4 and len(hover(fig, "tables")) == 4
    assert "B: logical block 1 → physical block 2" in hover(fig, "tables")[3]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pictures_fit_a_1280_by_720_screen(name):
    scenario = get_scenario(name, seed=2)
    for step in record(scenario)[:: max(1, len(scenario) // 4)]:
        fig = figure_step(scenario, step, caption=False)
        assert fig.layout.width <= 1200 and fig.layout.height <= 680


def test_live_sequences_never_share_a_colour():
    steps = record(get_scenario("random workload", seed=4))
    colours = assign_colours(steps)
    for step in steps:
        live = [colours[n] for n in step.snapshot.tables]
        assert len(live) == len(set(live))


def test_panel_steps_forward_back_and_reset_by_replay():
    panel = BlockPoolPanel()
    for _ in range(3):
        panel.next()
    assert panel.state["index"] == 3 and panel.state["snapshot"].tables == {"A": (0, 1), "B": (0, 2)}
    assert "copy-on-write" in panel.state["text"] and "Step 3 of 5" in panel.text.value
    panel.back()
    assert panel.state["step"] == step_at(walk_fork(), 2)
    for _ in range(10):
        panel.next()
    assert panel.state["index"] == 5 and panel.next_button.disabled and not panel.back_button.disabled
    panel.reset()
    assert panel.state["index"] == 0 and panel.back_button.disabled


def test_picking_a_scenario_or_a_seed_starts_it_over():
    panel = BlockPoolPanel()
    panel.next()
    panel.scenario.value = "random workload"
    assert panel.state["index"] == 0 and not panel.seed.disabled
    panel.seed.value = 7
    panel.next()
    assert panel.state["scenario"] == get_scenario("random workload", 7)
    assert len(panel.figure.data) == 3


def test_a_failing_redraw_shows_in_the_panel_and_keeps_the_last_state(monkeypatch):
    panel = BlockPoolPanel()
    before = panel.state

    def broken(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(viz, "panel_state", broken)
    panel.next_button.click()
    assert panel.state is before and "drawing failed" in str(panel.errors.outputs)
