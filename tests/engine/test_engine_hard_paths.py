"""The engine's comparison with transformers covers the paths where kernel bugs live, and fails on a broken kernel.

``compare_hard_paths`` (notebook 06 calls the same function) serves a 150-token prompt and a 70-token
one with 16-key tiles, split decodes and a token budget that ends chunks inside tiles. These tests
check that the run really covered those paths, that the tokens equal transformers', and that a
kernel without the online-softmax rescale, or with wrongly weighted split merges, breaks the equality.
"""

import pytest
import torch
from kvlab.kernels import KernelConfig, paged_attention
from kvlab.kernels import mutants as M

from kvlab.engine import LLMEngine
from kvlab.engine.hard_paths import HARD_PATH_CONFIG, compare_hard_paths
from kvlab.engine.toy import random_token_ids
from kvlab.errors import KvlabValueError


@pytest.fixture(scope="module")
def hard_run(tiny_llama_dir, hf_model):
    return compare_hard_paths(tiny_llama_dir, hf_model)


def test_the_hard_paths_match_transformers_token_for_token(hard_run):
    assert hard_run.equal, hard_run.summary()
    assert all(len(t) > 0 for t in hard_run.kvlab)


def test_the_run_covers_many_tiles_several_blocks_split_decodes_and_chunk_edges_inside_tiles(hard_run):
    assert hard_run.max_context >= 150
    assert hard_run.max_tiles >= 3 and hard_run.max_blocks >= 3
    assert hard_run.split_decode_steps >= 2 and hard_run.decode_kv_splits > 1
    assert hard_run.boundaries_inside_a_tile and all(p % hard_run.block_size for p in hard_run.boundaries_inside_a_tile)
    # prompt by prompt: the 150-token prompt cut at 44, 88, 132; the 70-token one starts with what its first step left
    assert hard_run.boundaries_by_prompt[0] == (44, 88, 132)
    assert sorted(sum(hard_run.boundaries_by_prompt, ())) == sorted(hard_run.chunk_boundaries)
    assert hard_run.summary()["chunk boundaries, by prompt"]["150-token prompt"] == [44, 88, 132]


def test_the_kernel_without_the_rescale_fails_the_comparison(tiny_llama_dir, hf_model):
    # deleting acc * alpha breaks every context that spans two tiles
    with M.using_kernels(paged_attention=M.mutant_attention("no_rescale")):
        broken = compare_hard_paths(tiny_llama_dir, hf_model)
    assert not broken.equal, f"the no-rescale kernel still matched transformers: {broken.summary()}"


def test_a_wrong_split_merge_fails_the_comparison_of_split_decodes(tiny_llama_dir, hf_model):
    # merge_weights breaks only split decodes, so one 70-token prompt (5 tiles over 2 splits) shows it
    short = dict(prompt_lens=(70,), max_tokens=4)
    assert compare_hard_paths(tiny_llama_dir, hf_model, **short).equal
    with M.using_kernels(paged_attention=M.mutant_attention("merge_weights")):
        broken = compare_hard_paths(tiny_llama_dir, hf_model, **short)
    assert not broken.equal and broken.agreeing_tokens[0] >= 1      # the prefill's token is right, decodes are not


def test_the_runner_knobs_reach_the_kernel(tiny_llama_dir):
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["config"], kwargs["num_kv_splits"], int(args[5][1:].sub(args[5][:-1]).max())))
        return paged_attention(*args, **kwargs)

    engine = LLMEngine(tiny_llama_dir, num_gpu_blocks=16, attention_backend="triton")
    config = KernelConfig(block_q=8, block_m=16, tile_n=16)
    engine.model_runner.kernel_config = config
    engine.model_runner.decode_kv_splits = 3
    with M.using_kernels(paged_attention=spy):
        engine.generate([random_token_ids(20, seed=1)], max_tokens=3)
    layers = engine.config.num_hidden_layers
    assert [c[1:] for c in calls[:layers]] == [(None, 20)] * layers              # the prefill is not split
    assert {c[1] for c in calls[layers:]} == {3}                                   # every decode step is
    assert all(c[0] is config for c in calls)
    assert HARD_PATH_CONFIG.tile_n == 16


@pytest.mark.parametrize(("knob", "value", "message"), [
    ("kernel_config", (32, 64, 16), "kernel_config must be a kvlab.kernels.KernelConfig"),
    ("decode_kv_splits", 0, "decode_kv_splits"),
    ("decode_kv_splits", 1.5, "decode_kv_splits"),
])
def test_bad_knobs_are_refused_and_change_nothing(tiny_llama_dir, knob, value, message):
    engine = LLMEngine(tiny_llama_dir, num_gpu_blocks=8)
    before = getattr(engine.model_runner, knob)
    with pytest.raises(KvlabValueError, match=message):
        setattr(engine.model_runner, knob, value)
    assert getattr(engine.model_runner, knob) == before
    assert torch.is_tensor(engine.kv_caches[0][0])
