"""A request's life through the block pool (notebook 04's stepper): the real manager's allocate, hit, free, evict."""

import pytest

from kvlab.errors import KvlabValueError
from kvlab.sim.lifecycle import EVENTS, lifecycle_step_at, lifecycle_steps
from kvlab.viz.lifecycle import LifecyclePanel, lifecycle_state


def test_each_event_moves_blocks_through_the_free_queue_as_vllm_does():
    steps = lifecycle_steps()
    assert len(steps) == len(EVENTS) + 1
    queue = [s.snapshot.free_queue_labels for s in steps]
    assert queue[0] == ["1", "2", "3", "4", "5", "6", "7"]             # block 0 is the null block
    assert steps[1].snapshot.tables == {"A": (1, 2, 3)}                 # allocate: from the head
    assert queue[2] == ["3", "4", "5", "6", "7", "2*", "1*"]            # free: partial to the head, cached to the tail
    assert steps[3].snapshot.tables == {"B": (1, 2, 3)} and "8 tokens cached in blocks 1, 2" in steps[3].text
    assert queue[3] == ["4", "5", "6", "7"]                              # the hit took 1 and 2 out of the queue
    assert steps[5].snapshot.tables == {"C": (4, 5, 6, 7, 3, 2)} and "evicts them" in steps[5].text
    assert steps[5].snapshot.blocks[2].block_hash != steps[4].snapshot.blocks[2].block_hash   # evicted, then C's
    assert "4 tokens cached in block 1" in steps[7].text                 # A's first block survived, its second did not


def test_a_step_is_a_replay_and_refuses_an_index_past_the_end():
    steps = lifecycle_steps()
    assert lifecycle_step_at(4) == steps[4]
    with pytest.raises(KvlabValueError, match="index"):
        lifecycle_step_at(len(EVENTS) + 1)


def test_the_panel_walks_the_same_steps_and_keeps_one_height():
    panel = LifecyclePanel()
    heights = {panel.figure.layout.height}
    for _ in range(5):
        panel.next()
        heights.add(panel.figure.layout.height)
    assert panel.state["index"] == 5 and panel.state["snapshot"] == lifecycle_steps()[5].snapshot
    assert len(heights) == 1
    panel.back()
    assert panel.state == {**lifecycle_state(4), "figure": panel.state["figure"]}
