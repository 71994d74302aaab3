"""What a tensor-parallel step costs in collectives: counted from the model's shape, timed on a link's bandwidth."""

from __future__ import annotations

import pytest

from kvlab.capacity.hardware import get_link
from kvlab.capacity.models import get_model
from kvlab.capacity.tp_cost import tp_step_collectives
from kvlab.errors import KvlabValueError

NVLINK, PCIE = "NVLink 4 (H100/H200 SXM)", "PCIe 5.0 x16"


def test_a_decode_step_makes_two_all_reduces_per_layer_plus_the_embedding_and_gathers_the_logits_once():
    spec = get_model("llama-3-70b")
    step = tp_step_collectives(spec, 8, num_seqs=64)
    assert (step.all_reduces, step.all_gathers) == (2 * spec.num_layers + 1, 1)
    assert step.all_reduce_payload_bytes == 64 * spec.hidden_size * 2  # tokens x hidden x bf16, whatever the tp
    vocab = spec.config["vocab_size"]
    assert step.all_gather_payload_bytes == 64 * (-(-vocab // 64) * 64 // 8) * 2  # padded to 64, split in 8
    assert tp_step_collectives(spec, 2, 64).all_reduce_payload_bytes == step.all_reduce_payload_bytes


def test_a_ring_sends_2_n_minus_1_over_n_of_each_all_reduce_and_the_time_follows_the_bandwidth():
    step = tp_step_collectives("llama-3-70b", 8, num_seqs=64)
    assert step.wire_bytes_per_rank == (step.all_reduces * 2 * 7 / 8 * step.all_reduce_payload_bytes
                                        + 7 * step.all_gather_payload_bytes)
    assert step.seconds(NVLINK) == step.wire_bytes_per_rank / get_link(NVLINK).bytes_per_s
    assert step.seconds(PCIE) > 7 * step.seconds(NVLINK)
    assert step.seconds(NVLINK, latency_s=1e-6) == pytest.approx(step.seconds(NVLINK) + step.ring_steps * 1e-6)


def test_one_rank_communicates_nothing_and_a_prefill_moves_every_token():
    one = tp_step_collectives("llama-3-8b", 1, num_seqs=4)
    assert (one.all_reduces, one.payload_bytes, one.wire_bytes_per_rank, one.seconds(PCIE)) == (0, 0, 0, 0)
    prefill = tp_step_collectives("llama-3-8b", 2, num_seqs=1, num_tokens=2048, activation_dtype="fp32")
    assert prefill.all_reduce_payload_bytes == 2048 * get_model("llama-3-8b").hidden_size * 4


def test_impossible_steps_are_refused_by_name():
    with pytest.raises(KvlabValueError, match="num_tokens=1 < num_seqs=2"):
        tp_step_collectives("llama-3-8b", 2, num_seqs=2, num_tokens=1)
    with pytest.raises(KvlabValueError, match="activation_dtype"):
        tp_step_collectives("llama-3-8b", 2, num_seqs=2, activation_dtype="fp8")
    with pytest.raises(KvlabValueError, match="latency_s"):
        tp_step_collectives("llama-3-8b", 2, 2).seconds(PCIE, latency_s=-1.0)
