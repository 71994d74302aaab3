"""The one-program tile kernel behind exercise 05.online_softmax computes masked attention exactly."""

import pytest
import torch
from kvlab.kernels import default_device, masked_attention
from kvlab.kernels.online_softmax import attention_by_tiles, softmax_states

from kvlab.errors import KernelInputError

DEVICE = default_device()


def random_block(num_keys, hidden_start=0):
    q, k, v = torch.randn(16, 32), torch.randn(num_keys, 32), torch.randn(num_keys, 32)
    visible = torch.rand(16, num_keys) < 0.7
    visible[:, -1] = True
    visible[:4, :hidden_start] = False
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), visible.to(DEVICE)


@pytest.mark.parametrize(("num_keys", "hidden_start"), [(9, 0), (50, 0), (64, 40)])
def test_tiles_agree_with_attention_in_one_go(num_keys, hidden_start):
    q, k, v, visible = random_block(num_keys, hidden_start)
    out = attention_by_tiles(q, k, v, visible)
    assert torch.allclose(out, masked_attention(q, k, v, visible), atol=1e-5)


def test_running_state_ends_at_the_true_max_and_sum():
    q, k, v, visible = random_block(50)
    states = softmax_states(q, k, v, visible)                       # [tiles, rows, (m, l)]
    scores = (q @ k.T / 32**0.5).masked_fill(~visible, float("-inf"))
    m = scores.max(dim=1).values
    assert torch.allclose(states[-1, :, 0], m, atol=1e-5)
    assert torch.allclose(states[-1, :, 1], torch.exp(scores - m[:, None]).sum(dim=1), rtol=1e-5)
    assert (states[1:, :, 0] >= states[:-1, :, 0]).all()            # the running max never goes down


def test_a_row_that_sees_nothing_is_refused():
    q, k, v, visible = random_block(20)
    visible[3] = False
    with pytest.raises(KernelInputError, match="every row must see at least one key"):
        attention_by_tiles(q, k, v, visible)
