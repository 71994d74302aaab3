"""The birthday bound that notebook 04's deliberate collision search is measured against."""

import math

import pytest

from kvlab.errors import KvlabValueError
from kvlab.sim.collisions import birthday_bound, find_block_collision, truncated_hash


def test_the_bound_for_a_16_bit_hash_is_about_321_draws():
    assert round(birthday_bound(16)) == 321 and birthday_bound(32) == pytest.approx(321 * 2**8, rel=1e-3)
    assert birthday_bound(16) == math.sqrt(math.pi / 2 * 2**16)
    with pytest.raises(KvlabValueError, match="bits"):
        birthday_bound(0)


def test_a_seeded_search_lands_near_the_bound():
    weak = truncated_hash("sha256", 16)
    tries = [len(find_block_collision(weak, 4, b"\0" * 32, seed=s).tried) for s in range(20)]
    assert 0.5 < (sum(tries) / len(tries)) / birthday_bound(16) < 1.5
