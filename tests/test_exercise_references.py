"""The new exercises' references agree with kvlab's own code run another way (the checkers trust them)."""

import random

import torch
from kvlab.kernels.layouts import to_legacy_layout

from kvlab.capacity.models import get_model, list_models
from kvlab.capacity.sizing import kv_bytes_per_token, kv_heads_per_rank
from kvlab.exercises.nb01 import tp_group_bytes
from kvlab.exercises.nb03 import sampling_blocks
from kvlab.exercises.nb05 import legacy_offsets
from kvlab.sim.block_scenarios import parallel_sampling, record


def _distinct(shape, dtype, bits_dtype, offset=0):
    """A cache whose every element has its own bit pattern (compared as integers, so NaN patterns are fine)."""
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.int64) + offset).to(bits_dtype).view(dtype).reshape(shape)


def test_legacy_offsets_point_at_the_element_to_legacy_layout_moved_there():
    rng = random.Random(0)
    cases = (("fp32", torch.float32, torch.int32, (3, 8, 2, 32)), ("bf16", torch.bfloat16, torch.int16, (3, 8, 2, 32)),
             ("fp8", torch.float8_e4m3fn, torch.uint8, (2, 4, 1, 32)))   # 256 elements: each uint8 once
    for dtype, torch_dtype, bits, shape in cases:
        num_blocks, block_size, heads, head_size = shape
        key, value = _distinct(shape, torch_dtype, bits), _distinct(shape, torch_dtype, bits)
        k5, v4 = (t.view(bits).flatten() for t in to_legacy_layout(key, value))
        for _ in range(50):
            slot, head, dim = rng.randrange(num_blocks * block_size), rng.randrange(heads), rng.randrange(head_size)
            k_index, v_index = legacy_offsets(slot, head, dim, heads, head_size, block_size, dtype)
            block, offset = divmod(slot, block_size)
            assert k5[k_index] == key.view(bits)[block, offset, head, dim], (dtype, slot, head, dim)
            assert v4[v_index] == value.view(bits)[block, offset, head, dim], (dtype, slot, head, dim)


def test_sampling_blocks_is_what_the_step_through_scenario_shows():
    for n, prompt, block_size in ((4, 40, 16), (3, 32, 16), (5, 7, 4)):
        steps = record(parallel_sampling(n=n, prompt_tokens=prompt, block_size=block_size, new_tokens=0))
        after_one_token = steps[2 * n].snapshot  # start, n - 1 forks, n appends of one token
        copies = sum(len(s.copies) for s in steps[: 2 * n + 1])
        assert sampling_blocks(n, prompt, 1, block_size) == (after_one_token.num_live_blocks, copies)


def test_tp_group_bytes_is_every_rank_s_share_added_up():
    for name in list_models():
        model = get_model(name)
        config = {k: v for k, v in model.config.items() if not k.startswith("_")}
        for tp in (1, 2, 8, 16):
            heads = 1 if model.attention == "mla" else model.num_kv_heads
            if heads % tp and tp % heads and model.attention != "mla":
                continue
            total = sum(kv_bytes_per_token(model, "bf16", tp) for _ in range(tp))
            assert tp_group_bytes(config, "bf16", tp) == total
            assert total // tp == kv_bytes_per_token(model, "bf16") * kv_heads_per_rank(model, tp) // (
                kv_heads_per_rank(model, 1))
