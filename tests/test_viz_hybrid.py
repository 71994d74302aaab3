"""Notebook 08's stepper and pictures are thin views over kvlab's manager: the numbers are the library's."""

import pytest

import kvlab.viz.hybrid as viz
from kvlab.errors import KvlabValueError
from kvlab.sim.hybrid_hits import hit_walkthrough


def test_the_walkthrough_is_the_managers_own_hit_kind_by_kind():
    walk = hit_walkthrough(40, 8, 4, evict_sliding=(4,), evict_full=(6,))
    assert walk.alone == (40, 24) and walk.hit_tokens == 16 and walk.needed == 2
    assert walk.cached[0][4] is False and walk.cached[1][6] is False and sum(walk.cached[1]) == 9
    assert walk.rounds == ((1, "full attention", 40, 24), (1, "sliding window", 24, 16))
    assert walk.hit_block_ids[0][:2] == (0, 0) and 0 not in walk.hit_block_ids[1]
    nothing_evicted = hit_walkthrough(40, 8, 4)
    assert nothing_evicted.hit_tokens == 40 == nothing_evicted.alone[0] == nothing_evicted.alone[1]
    with pytest.raises(KvlabValueError, match="evict_full"):
        hit_walkthrough(40, 8, 4, evict_full=(10,))


def test_each_step_colours_what_its_caption_says():
    walk = hit_walkthrough(40, 8, 4, evict_sliding=(8,))
    cells = [viz._cells(walk, step) for step in range(5)]
    assert cells[0][0][8] == "evicted" and cells[0][1].count("cached") == 10
    assert cells[1][1].count("scanned") == 10                               # full attention alone: 40 tokens
    assert cells[2][0].count("scanned") == 2 and cells[2][0][6:8] == ["scanned"] * 2   # the window's 2 blocks
    assert cells[4][0][:6] == ["null"] * 6 and cells[4][0][6:8] == ["hit"] * 2 and cells[4][1][:8] == ["hit"] * 8
    assert "32" in viz.step_caption(walk, 4) and "round 1" in viz.step_caption(walk, 3)
    assert [t.name for t in viz.figure_hit_steps(walk, 4).data] == list(viz.COLOURS)


def test_the_panel_recomputes_on_every_control_and_shows_errors(monkeypatch):
    panel = viz.HybridHitPanel()
    assert panel.state["hit_tokens"] == 32 and panel.state["step"] == 0
    panel.step.value = 4
    assert panel.state["step"] == 4 and "B hits 32" in panel.state["caption"]
    panel.window.value = 20
    assert panel.state["walkthrough"].needed == 5 and panel.state["hit_tokens"] == 32
    before = panel.state

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(viz, "hit_walkthrough", broken)
    panel.evict_full.value = 3
    assert panel.state is before and "simulated failure" in str(panel.errors.outputs)


def test_the_pool_figure_plots_what_was_measured():
    from kvlab.engine.hybrid import PoolUsage

    hybrid = PoolUsage(True, [[1]], [1024, 2048, 0], 1024, 10, 10240)
    full = PoolUsage(False, [[1]], [2048, 4096, 0], 2048, 10, 20480)
    fig = viz.figure_pool_usage(hybrid, full)
    assert [list(t.y) for t in fig.data] == [[2.0, 4.0, 0.0], [1.0, 2.0, 0.0]] and hybrid.peak_bytes == 2048
