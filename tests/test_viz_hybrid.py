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
    assert [t.name for t in viz.figure_hit_steps(walk, 4).data][:5] == list(viz.COLOURS)


def test_the_hit_is_drawn_in_tokens_and_the_agreement_round_by_round():
    walk = hit_walkthrough(40, 8, 4, evict_sliding=(4,), evict_full=(6,))     # 40 -> 24 -> 16
    before = viz.figure_hit_steps(walk, 2)
    assert "tokens" in before.layout.xaxis.title.text and not [t for t in before.data if t.name == "offered"]
    cached = next(t for t in before.data if t.name == "cached")
    assert all(base % 4 == 0 for base in cached.base) and set(cached.x) == {4}  # each block: 4 tokens wide
    rounds = viz.figure_hit_steps(walk, 3)
    offered, accepted = (next(t for t in rounds.data if t.name == n) for n in ("offered", "accepted"))
    assert list(offered.x) == [40, 24] and list(accepted.x) == [24, 16]
    assert list(offered.y) == ["round 1: full attention", "round 2: sliding window"]
    labels = next(t for t in rounds.data if t.type == "scatter")
    assert [t.strip() for t in labels.text] == ["40 → 24 tokens", "24 → 16 tokens"]
    assert rounds.layout.height > before.layout.height                      # a row per round


def test_one_pool_two_tables_null_entries_bundled_and_the_layer_that_writes_each_page():
    fig = viz.figure_hybrid_pool(([0, 0, 0, 4, 5, 11], [6, 7, 8, 9, 10, 12]), ([0, 2], [1, 3]), 16)
    arrows = [a for a in fig.layout.annotations if a.showarrow]
    assert len(arrows) == 3 + 6 + 1                      # each own entry, and one for the three null entries
    assert sum(a.arrowcolor == viz.GROUP_COLOURS[0] for a in arrows) == 3
    assert sum(a.arrowcolor == viz.GROUP_COLOURS[1] for a in arrows) == 6
    pool = [t for t in fig.data if t.name == "pool"][0].hovertext
    assert pool[4] == "block 4: pair 0: layer 0, pair 1: layer 2"
    assert pool[6] == "block 6: pair 0: layer 1, pair 1: layer 3"
    assert pool[0].startswith("block 0: the null block") and pool[13] == "block 13: no layer (free)"
    tables = [t for t in fig.data if t.name == "tables"][0].hovertext
    assert tables[:3] == tuple(f"sliding window: logical block {i} → the null block" for i in range(3))
    assert fig.layout.width <= 1200 and fig.layout.height <= 680
    with pytest.raises(KvlabValueError, match="num_blocks"):
        viz.figure_hybrid_pool(([0, 4], [6]), ([0], [1]), 5)
    with pytest.raises(KvlabValueError, match="group_layers"):
        viz.figure_hybrid_pool(([0, 4], [6]), ([0, 2], [1]), 16)


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
