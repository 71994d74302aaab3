"""Notebook 03's picture and step-through panel: thin views over the recorded scenarios."""

import pytest

import kvlab.viz.block_pool as viz
import kvlab.viz.step_panels as panels
from kvlab.errors import UnknownNameError
from kvlab.sim.block_scenarios import SCENARIOS, get_scenario, record, step_at, walk_fork, walk_free_queue
from kvlab.viz.block_pool import assign_colours, figure_pool, figure_step
from kvlab.viz.step_panels import BlockPoolPanel


def hover(fig, part):
    (trace,) = [t for t in fig.data if t.name == part]
    return list(trace.hovertext)


def texts(fig):
    return [a.text for a in fig.layout.annotations if a.text]


def test_figure_draws_every_block_every_table_entry_and_the_queue_in_order():
    scenario = walk_free_queue()
    step = record(scenario)[3]  # A released: queue 2, 3, 4, 5, 1*, 0*
    fig = figure_step(scenario, step)
    assert len(hover(fig, "pool")) == 6 and hover(fig, "tables") == []
    assert [t.split(":")[0] for t in hover(fig, "queue")] == [f"queue position {i}" for i in range(6)]
    assert "block 1: cached" in hover(fig, "queue")[4]
    shown = texts(fig)
    assert "<b>1*</b>" in shown and "<b>0*</b>" in shown and any("step 3 of 4" in t for t in shown)




def test_arrows_go_from_each_table_entry_up_to_its_block_and_never_through_a_cell():
    step = record(walk_fork())[3]  # A [0, 1], B [0, 2]: block 0 shared
    fig = figure_pool(step.snapshot)
    colours = set(viz.SEQUENCE_COLOURS)
    own = [a for a in fig.layout.annotations if a.showarrow and a.arrowcolor in colours]
    shared = [a for a in fig.layout.annotations if a.showarrow and a.arrowcolor == viz.INK]
    assert len(own) == 2 and len(shared) == 1 and len(hover(fig, "tables")) == 4
    assert "B: logical block 1 → physical block 2" in hover(fig, "tables")[3]
    stubs = [s for s in fig.layout.shapes if s.type == "line" and s.line.color in colours]
    assert len(stubs) == 2 and len({round(s.x0) for s in stubs}) == 2   # one stub from each of A's and B's entry 0
    heads, tails = {a.y for a in own + shared}, {a.ay for a in own}
    assert len(heads) == 1 and len(tails) == 1 and min(tails) > max(heads)   # shelf top -> pool bottom, upwards
    cells = [s for s in fig.layout.shapes if s.type == "rect" and s.fillcolor in colours]
    crossed = [c for c in cells if c.y0 < min(tails) and c.y1 > max(heads) and c.y1 - c.y0 < 40]
    assert crossed == []                  # no table cell sits between the shelf and the pool
    pool_x = sorted(round(x) for x in fig.data[0].x)
    assert round(shared[0].x) == pool_x[0]                                   # the bundle's arrow: up to block 0
    assert sorted(round(a.x) for a in own) == pool_x[1:3]                    # A's own block 1, B's own block 2


def _crosses(a, b) -> bool:
    """Whether two arrows (tail ax, ay to head x, y) cross between their ends."""
    def side(p, q, r):
        return (q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0])
    p1, p2, p3, p4 = (a.ax, a.ay), (a.x, a.y), (b.ax, b.ay), (b.x, b.y)
    return side(p1, p2, p3) * side(p1, p2, p4) < 0 and side(p3, p4, p1) * side(p3, p4, p2) < 0


def test_a_fork_s_tables_follow_the_pool_and_its_shared_blocks_are_bundled_so_no_arrows_cross():
    scenario = get_scenario("parallel sampling (n = 4)")
    step = record(scenario)[8]  # S0 [1, 2, 4], S1 [1, 2, 5], S2 [1, 2, 6], S3 [1, 2, 3]
    fig = figure_step(scenario, step)
    arrows = [a for a in fig.layout.annotations if a.showarrow and a.arrowcolor != viz.COPY_COLOUR]
    assert len(arrows) == 4 + 2                       # one per table's own block, one per shared block (not 12)
    assert not any(_crosses(a, b) for i, a in enumerate(arrows) for b in arrows[i + 1:])
    names = [t for t in texts(fig) if t.startswith("<span") and "tokens" in t]
    assert [n.split("<b>")[1].split("</b>")[0] for n in names] == ["S3", "S0", "S1", "S2"]   # own blocks 3, 4, 5, 6
    joints = [s for s in fig.layout.shapes if s.type == "circle"]
    assert len(joints) == 2 * 4 + 2                   # a dot where each stub meets its bus, and under each arrow


def test_copy_on_write_before_and_after_as_one_picture_that_fits_a_screen():
    scenario = walk_fork()
    steps = record(scenario)
    fig = viz.figure_before_after(scenario, steps[2], steps[3])
    shown = " ".join(texts(fig))
    assert "<b>before</b> (step 2 of 5)" in shown and "<b>after</b> (step 3 of 5)" in shown
    assert shown.count("<b>copy 1 → 2</b>") == 1                            # the copy, drawn in the after half
    pool = hover(fig, "pool")
    assert len(pool) == 2 * 8 and "ref_cnt 2" in pool[1] and "ref_cnt 1" in pool[8 + 1]   # block 1: shared, then A's
    assert fig.layout.width <= 1200 and fig.layout.height <= 680
    assert not [t for t in hover(fig, "tables") if "queue" in t]            # no free queue: the pair fits


def test_a_copy_on_write_copy_is_drawn_as_an_arc_from_the_shared_block_to_its_copy():
    scenario = walk_fork()
    step = record(scenario)[3]
    assert step.copies == ((1, 2),)
    fig = figure_step(scenario, step)
    arcs = [s for s in fig.layout.shapes if s.type == "path" and s.line.color == viz.COPY_COLOUR]
    assert len(arcs) == 2                                   # the legend's sample and the copy itself
    assert "<b>copy 1 → 2</b>" in texts(fig)
    before = figure_step(scenario, record(scenario)[2])  # the fork: nothing copied yet
    assert not [t for t in texts(before) if t.startswith("<b>copy ")]
    assert len([s for s in before.layout.shapes if s.type == "path"]) == 1


def test_tokens_are_words_as_in_the_paper_and_ids_one_toggle_away():
    scenario = walk_fork()
    step = record(scenario)[1]  # A holds tokens 0..5 in blocks 0 and 1
    words = texts(figure_step(scenario, step))
    assert [w for w in words if w in ("Four", "score", "and", "seven", "years", "ago")] == [
        "Four", "score", "and", "seven", "years", "ago"]
    ids = texts(figure_step(scenario, step, tokens="ids"))
    assert [t for t in ids if t in {str(i) for i in range(6)} and t not in ("0", "1")] == ["2", "3", "4", "5"]
    assert "Four" not in ids
    with pytest.raises(UnknownNameError, match="tokens"):
        figure_step(scenario, step, tokens="letters")


def test_large_blocks_show_how_full_they_are_and_their_words_on_hover():
    scenario = get_scenario("parallel sampling (n = 4)")
    step = record(scenario)[1]  # the 40-token prompt in blocks 1, 2, 3 of 16 slots
    fig = figure_step(scenario, step)
    assert "Four" not in texts(fig)
    tip = hover(fig, "pool")[1]
    assert "16 of 16 slots written" in tip and "holds: Four score and seven" in tip


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


def test_the_tokens_toggle_redraws_the_same_step_with_ids():
    panel = BlockPoolPanel()
    panel.next()
    panel.tokens.value = "ids"
    assert panel.state["index"] == 1 and panel.state["tokens"] == "ids"
    assert "Four" not in texts(panel.figure) and "5" in texts(panel.figure)
    panel.tokens.value = "words"
    assert "Four" in texts(panel.figure)


def test_a_failing_redraw_shows_in_the_panel_and_keeps_the_last_state(monkeypatch):
    panel = BlockPoolPanel()
    before = panel.state

    def broken(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(panels, "panel_state", broken)
    panel.next_button.click()
    assert panel.state is before and "drawing failed" in str(panel.errors.outputs)
