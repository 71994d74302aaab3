"""Helpers shared by the engine tests (fixtures live in conftest.py)."""

import torch


def random_prompt(length, seed, vocab_size=256):
    """Token ids 3..vocab-1 (0-2 are pad/bos/eos), reproducible."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()
