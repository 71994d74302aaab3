"""vLLM's code beside kvlab's, with vLLM 0.33.0 installed: the source shown is vLLM's own, and an answer runs
against vLLM's own classes (kvlab.exercises.beside_vllm; without vLLM, tests/test_beside_vllm.py)."""

from __future__ import annotations

import inspect
import random
import textwrap

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="vLLM 0.33.0 is not installed here: run make test-vllm")

import vllm.v1.core.block_pool as vllm_block_pool  # noqa: E402
import vllm.v1.core.single_type_kv_cache_manager as vllm_managers  # noqa: E402

import kvlab.exercises as ex  # noqa: E402
import kvlab.exercises.beside_vllm as side  # noqa: E402
from kvlab.core.block_pool import BlockPool  # noqa: E402
from kvlab.exercises.plain import free_queue_order  # noqa: E402

# every vLLM function a notebook shows beside kvlab's
SHOWN = {
    "vllm/v1/core/block_pool.py:BlockPool.free_blocks": vllm_block_pool.BlockPool.free_blocks,
    "vllm/v1/core/single_type_kv_cache_manager.py:SlidingWindowManager.get_num_skipped_tokens":
        vllm_managers.SlidingWindowManager.get_num_skipped_tokens,
}


@pytest.mark.parametrize("name", sorted(SHOWN))
def test_the_source_shown_is_what_inspect_getsource_gives_for_the_installed_vllm(name):
    install = side.find_vllm()
    assert install is not None and install.python is None and install.version == "0.33.0"
    assert side.vllm_source(name) == textwrap.dedent(inspect.getsource(SHOWN[name]))


def test_beside_shows_both_sources_with_no_note():
    shown = side.beside(BlockPool._free_blocks, "vllm/v1/core/block_pool.py:BlockPool.free_blocks")
    assert "prepend_n" in shown.vllm_source and shown.note == "" and shown._repr_html_().count("<pre") == 2


def test_the_vllm_built_reference_agrees_with_kvlab_s_on_many_cases():
    exercise, reference = ex.get_exercise("03.free_queue_order"), side.REFERENCES_ON_VLLM["03.free_queue_order"][0]
    rng = random.Random(0)
    for case in [*exercise.edge_cases, *(exercise.random_case(rng) for _ in range(300))]:
        assert reference(*case.args) == exercise.reference(*case.args), case


def test_a_right_answer_agrees_with_vllm_and_a_wrong_one_is_shown_where_it_parts():
    assert side.against_vllm("03.free_queue_order", free_queue_order, seed=1).passed

    def one_at_a_time(queue, table, cached):
        """Prepends the blocks without a hash one by one, which reverses their order."""
        head = [b for b in table if b not in cached]          # reversed(table), each put in front: table order
        return head + list(queue) + [b for b in reversed(table) if b in cached]

    result = side.against_vllm("03.free_queue_order", one_at_a_time, seed=1)
    assert result.status == "fail" and "vLLM 0.33.0's own BlockPool.free_blocks" in result.message
