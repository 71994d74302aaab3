"""``@checked``'s inline doors: the checks written into the function's own body, so a door costs no extra call."""

from __future__ import annotations

import inspect
import sys
import traceback

import pytest

from kvlab._validate import checked
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import Request
from kvlab.errors import KvlabValueError


class Pool:
    """A stand-in for a door: a count and a list, both checked at the top of the method."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    @checked(inline=True)
    def take(self, n: int, tags: list[int] | None = None, *, note: str = "") -> int:
        """Take ``n``."""
        self.taken.append(n)
        return n + len(tags or ())


class Base:
    def size(self, n: int) -> int:
        return n


class Child(Base):
    @checked(inline=True)
    def size(self, n: int) -> int:  # super() needs a closure: @checked writes a wrapper instead
        return super().size(n) + 1


def _calls(fn, *args, **kwargs) -> list[str]:
    """The Python functions one call enters, in order (``sys.setprofile``); a checking wrapper shows as ``<checked``."""
    names: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            names.append("<checked" if code.co_filename.startswith("<checked") else code.co_name)

    sys.setprofile(profile)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return names


def test_an_inline_door_checks_its_arguments_by_name_and_changes_nothing():
    pool = Pool()
    assert pool.take(2, [1, 2], note="x") == 4 and pool.take(n=1) == 1
    for call, named in ((lambda: pool.take(-1), "n"), (lambda: pool.take("2"), "n"),
                        (lambda: pool.take(1, ["a"]), "tags[0]"), (lambda: pool.take(1, note=5), "note")):
        with pytest.raises(KvlabValueError, match=rf"^{named.replace('[', '.').replace(']', '.')} must be"):
            call()
    assert pool.taken == [2, 1]


def test_an_inline_door_is_one_frame_at_its_own_lines():
    pool = Pool()
    pool.take(1)  # the first call writes the checks in
    assert _calls(pool.take, 3) == ["take"]  # no wrapper: the checks run inside the method itself
    with pytest.raises(KvlabValueError) as info:
        pool.take(-1)
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == __file__ and frame.lineno == inspect.getsourcelines(Pool.take.__wrapped__)[1] + 1
    assert inspect.signature(Pool.take) == inspect.signature(Pool.take.__wrapped__)
    assert Pool.take.__doc__ == "Take ``n``."
    assert Pool.take.__wrapped__(pool, -5) == -5  # kvlab's own calls may still skip the door


def test_a_door_that_needs_a_closure_gets_a_wrapper_and_is_still_checked():
    assert Child().size(1) == 2 and "<checked" in _calls(Child().size, 1)
    with pytest.raises(KvlabValueError, match="^n must be"):
        Child().size(-1)


def test_the_managers_hot_doors_enter_no_checking_wrapper():
    """``allocate_slots``, ``get_computed_blocks`` and ``free``: one frame each, plus ``_check_allocation``'s."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = Request("r", [1, 2, 3, 4, 5])
    hits, n, _ = manager.get_computed_blocks(request)
    manager.allocate_slots(request, 5 - n, n, hits)
    request.num_computed_tokens = 5
    request.append_output_token_ids(6)
    entered = _calls(manager.allocate_slots, request, 1) + _calls(manager.get_computed_blocks, Request("s", [1]))
    entered += _calls(manager.free, request)
    assert "<checked" not in entered and entered[:1] == ["allocate_slots"]
    assert entered.count("_check_allocation") == 1
    with pytest.raises(KvlabValueError, match="^num_new_tokens must be"):
        manager.allocate_slots(request, -1)
