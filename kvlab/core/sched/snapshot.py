"""A copy of everything a scheduler step can change, to put back if the step raises: the step is a transaction.

``Snapshot(scheduler)`` walks the objects reachable from the scheduler (its queues and requests, the
KV cache manager and its coordinators, the block pool, its free queue and prefix-cache index, the CPU
tier's bookkeeping, the metrics collector) and keeps a shallow copy of each one's contents: a list's
items, a dict's entries, an object's attributes. ``restore()`` writes them back into the same
objects, so every reference anyone holds (the engine's ``kv_cache_manager``, a learner's ``pool``)
sees the state from before the step. The walk is generic on purpose: it needs no list of what each
class keeps, so it stays right as ``kvlab.core`` changes. Immutable values (numbers, strings, bytes,
enums, frozensets) are shared; functions, classes and modules are left alone, as are objects with
neither ``__dict__`` nor ``__slots__`` (locks, C objects); a ``random.Random`` keeps its state.

A pool's blocks are not copied: while a snapshot is open, each ``KVCacheBlock`` notes its own slots in
its pool's journal before its first change (``kvlab.core.kv_cache_utils.open_journal``: the class's
``__setattr__`` is swapped in while some journal is open, so outside a step a write to a block costs
nothing extra), and ``restore()`` writes those back first; ``commit()`` ends the journals when the step
succeeded, ``restore()`` when it was undone. The pool's own list of its blocks, fixed when the pool is
made, is recognised and skipped; so a snapshot costs what the scheduler's queues, requests and indexes
hold, not the pool's size (8,193 blocks for the tiny Llama: 3-7 ms when every block was copied, a pass
over the list still cost about 0.5 ms; ``benchmarks/bench_step.py`` on a shared, loaded 2-core machine),
and an undo costs the blocks the step touched. Requests journal themselves the same way
(``kvlab.core.request.Journal``): the walk only notes which it found, so a queue of a thousand waiting
requests costs one pass over the queue, not a copy of each request (at 63 waiting, the record fell from
about 0.8 ms to a tenth of that). A list of objects of one other slotted class is saved in one pass, and
what they refer to is walked from its first item only.
"""

from __future__ import annotations

import enum
import functools
import operator
import random
import types
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from kvlab.core import request as request_journal
from kvlab.core.kv_cache_utils import KVCacheBlock, close_journal, open_journal
from kvlab.core.request import Request
from kvlab.core.sched.output import SamplingParams, ScheduledRequest, SchedulerOutput

#: Values a step may replace but never changes in place: kept by reference, not walked (among them a step's
#: output and its frozen records of numbers and tuples, one per request, which nothing changes once made).
_ATOMS: tuple[type, ...] = (int, float, complex, str, bytes, bool, type(None), range, frozenset, enum.Enum, type,
                            types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
                            SamplingParams, ScheduledRequest, SchedulerOutput)
_UNSET = object()  # a slot that holds nothing
_T = TypeVar("_T")
_POOL_OF = operator.attrgetter("_pool")


@functools.cache  # a class is an atom or not once and for all
def _is_atom(cls: type) -> bool:
    return issubclass(cls, _ATOMS)


def _extend(queue: deque[Any], items: Any) -> None:
    """Queue what ``items`` hold, unless every one is an atom (a request's token ids: checked at C speed)."""
    if not all(map(_is_atom, set(map(type, items)))):
        queue.extend(items)


class Snapshot:
    """The state of every mutable object reachable from ``root``, for ``restore()`` to put back in place."""

    def __init__(self, root: object) -> None:
        self._saved: list[tuple[Any, Any]] = []  # (object, its contents), or (_Items, the items' contents)
        self._seen: set[int] = set()
        self._pools: dict[int, Any] = {}  # the pools whose blocks journal their own changes
        self._root = root
        self._request_ids: set[int] = set()  # the requests found, which journal their own changes
        queue = deque([root])  # breadth first: the pool's list of blocks comes before the free queue's links
        seen, is_atom = self._seen, _is_atom
        while queue:
            obj = queue.popleft()
            if not is_atom(type(obj)) and id(obj) not in seen:
                seen.add(id(obj))
                self._save(obj, queue)
        # Opened last, so the walk above changes nothing they record; a fresh journal replaces one an interrupt
        # left open between a snapshot and its step.
        self._journals = [open_journal(pool) for pool in self._pools.values()]
        self._requests = request_journal.open_journal(root, self._request_ids)

    def _journaled(self, block: Any) -> bool:
        """True for a block of a pool (it notes its own state before a change); its pool joins ``_pools``."""
        pool = block._pool
        if pool is None or not hasattr(pool, "_journal"):
            return False
        self._pools[id(pool)] = pool
        return True

    def _is_pool_list(self, blocks: list[Any]) -> bool:
        """True for the block list of a pool that journals (``BlockPool.blocks``); the pool joins ``_pools``."""
        pool = blocks[0]._pool
        if getattr(pool, "blocks", None) is not blocks or not hasattr(pool, "_journal"):
            return False
        self._pools[id(pool)] = pool
        return True

    def close(self) -> None:
        """The step succeeded (or was undone): stop the pools' journals (``restore`` is no longer possible)."""
        for pool in self._pools.values():
            close_journal(pool)
        request_journal.close_journal(self._root, self._requests)

    def _save(self, obj: Any, queue: deque[Any]) -> None:
        """Keep a shallow copy of ``obj``'s contents; what it refers to joins ``queue``."""
        if isinstance(obj, KVCacheBlock) and self._journaled(obj):
            return
        if isinstance(obj, Request):  # notes itself before its first change (``kvlab.core.request.Journal``)
            self._request_ids.add(id(obj))
            return
        if isinstance(obj, tuple):  # named tuples too: immutable, but they may hold what is not
            _extend(queue, obj)
        elif type(obj) is list and obj and type(obj[0]) is KVCacheBlock and self._is_pool_list(obj):
            return  # a pool's own list of its blocks: fixed at its making, and every block journals itself
        elif isinstance(obj, list | deque | dict):
            items = list(obj.values() if isinstance(obj, dict) else obj)
            self._saved.append((obj, dict(obj) if isinstance(obj, dict) else items))
            if len(items) > 1 and self._save_alike(items, queue):
                return
            _extend(queue, items)  # a dict's keys are hashable, so never changed in place
        elif isinstance(obj, set):
            self._saved.append((obj, set(obj)))
            _extend(queue, obj)
        elif isinstance(obj, random.Random):
            self._saved.append((obj, obj.getstate()))
        else:
            attrs = getattr(obj, "__dict__", None)
            slots = _slots_of(type(obj))(obj) if _slot_names(type(obj)) else None
            if attrs is None and slots is None:
                return  # a lock, a C object: nothing a step changes
            if attrs is not None:
                attrs = dict(attrs)
                queue.extend(attrs.values())
            if slots is not None:
                queue.extend(slots)
            self._saved.append((obj, (attrs, slots)))

    def _save_alike(self, items: list[Any], queue: deque[Any]) -> bool:
        """Save many items of one class in one pass (the pool's blocks, the prefix index's dicts) and walk
        what they refer to from the first only; False if the items are not alike."""
        cls = type(items[0])
        if set(map(type, items)) != {cls} or isinstance(items[0], (*_ATOMS, tuple)):
            return False
        if issubclass(cls, Request):  # a queue of requests: each notes itself before its first change
            self._request_ids.update(map(id, items))
            return True
        if cls is KVCacheBlock:  # a pool's blocks journal themselves: one C-speed pass to find their pools
            pools = list(dict.fromkeys(map(_POOL_OF, items)))
            if None not in pools and all(hasattr(pool, "_journal") for pool in pools):
                self._pools.update((id(pool), pool) for pool in pools)
                return True
        fresh = [item for item in items if id(item) not in self._seen]
        if cls in (dict, set, list):
            self._saved += [(item, cls(item)) for item in fresh]
        elif _slot_names(cls) and not hasattr(items[0], "__dict__"):
            self._saved.append((_Items(cls, fresh), _all_slots(cls, fresh)))
        else:
            return False
        self._seen.update(map(id, fresh))
        first = items[0]
        queue.extend(first.values() if cls is dict else first if cls in (set, list) else _slots_of(cls)(first))
        return True

    def restore(self) -> None:
        """Put every saved object back as it was when the snapshot was taken (the journals' blocks first), and
        close the journals."""
        self._requests.restore()
        names = _slot_names(KVCacheBlock)
        for journal in self._journals:
            for block, values in journal.items():
                _set_slots(block, names, values)
        for obj, state in self._saved:
            if isinstance(obj, _Items):
                names = _slot_names(obj.cls)
                for item, values in zip(obj.items, state, strict=True):
                    _set_slots(item, names, values[:len(names)])
            elif isinstance(obj, list):
                obj[:] = state
            elif isinstance(obj, deque):
                obj.clear()
                obj.extend(state)
            elif isinstance(obj, dict | set):
                obj.clear()
                obj.update(state)
            elif isinstance(obj, random.Random):
                obj.setstate(state)
            else:
                attrs, slots = state
                if attrs is not None:
                    obj.__dict__.clear()
                    obj.__dict__.update(attrs)
                if slots is not None:
                    _set_slots(obj, _slot_names(type(obj)), slots)
        self.close()


def commit(snapshot: Snapshot | None, result: _T) -> _T:
    """The step succeeded: close ``snapshot``'s journals (if any) and return ``result``.

    ``loop.step`` returns through this, so the journals close after the step's last line of
    ``kvlab.core`` ran and before the step returns: an interrupt on any earlier line still finds
    them open, and undoes the step.
    """
    if snapshot is not None:
        snapshot.close()
    return result


class _Items:
    """The items of one list of slotted objects, saved together."""

    def __init__(self, cls: type, items: list[Any]) -> None:
        self.cls, self.items = cls, items


@functools.cache  # a class's layout never changes
def _slot_names(cls: type) -> tuple[str, ...]:
    """Every ``__slots__`` name of ``cls`` and its bases, ``__dict__`` and ``__weakref__`` aside."""
    found: list[str] = []
    for base in cls.__mro__:
        declared = base.__dict__.get("__slots__", ())
        found += [declared] if isinstance(declared, str) else list(declared)
    return tuple(n for n in dict.fromkeys(found) if n not in ("__dict__", "__weakref__"))


def _slots_of(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """A function giving an object's slot values, as a tuple (``_UNSET`` where a slot holds nothing)."""
    names = _slot_names(cls)
    return lambda obj: tuple(getattr(obj, n, _UNSET) for n in names)


def _all_slots(cls: type, items: list[Any]) -> list[tuple[Any, ...]]:
    """Every item's slot values, in one C-speed pass when every slot is set (blocks' slots always are)."""
    names = _slot_names(cls)
    try:
        return list(map(operator.attrgetter(*names, names[0]), items))  # the tuple always has >= 2 values
    except AttributeError:
        return list(map(_slots_of(cls), items))


def _set_slots(obj: Any, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
    for name, value in zip(names, values, strict=True):
        if value is not _UNSET:
            object.__setattr__(obj, name, value)
        elif hasattr(obj, name):
            object.__delattr__(obj, name)
