"""A request as the KV cache manager sees it: token ids, how many are computed, and block hashes.

Mirrors ``vllm/v1/request.py`` with what the prefix cache and a scheduler need: the prompt,
the output tokens appended one by one, ``num_computed_tokens``, the chained ``block_hashes``
of its full blocks, the keys that isolate it (``cache_salt``, ``lora_name``, multimodal
items), ``status`` and ``num_preemptions``. vLLM keeps a whole ``LoRARequest``; kvlab keeps
the two fields that enter the block hash, the adapter's name and its path (vLLM requires a
path; kvlab uses the name when none is given).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from kvlab._validate import checked, non_negative_int, positive_int
from kvlab.errors import KvlabValueError, RequestStateError


@checked
@dataclasses.dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item's placeholder tokens sit in the prompt: ``offset``, ``length``."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        non_negative_int("offset", self.offset)
        positive_int("length", self.length)


@checked
@dataclasses.dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One image (or audio clip...) of a prompt: a content ``identifier`` and its placeholder range.

    The placeholder tokens are the same for every image; only ``identifier`` (vLLM uses a
    hash of the pixels) tells two images apart, so it must enter the block hash.
    """

    identifier: str
    mm_position: PlaceholderRange


class RequestStatus(enum.Enum):
    """Where a request is in its life, as vLLM's ``RequestStatus`` names it (a subset).

    ``FINISHED_ABORTED`` is a request its client gave up (``LLMEngine.abort_request``);
    ``FINISHED_ERROR`` is vLLM's request-level internal error (finish reason ``"error"``): kvlab
    gives it to a request whose step failed (the executor raised, or returned no usable token
    for it), so the request ends, its blocks are freed, and the engine serves the others.
    ``WAITING_FOR_REMOTE_KVS``: the request holds blocks a KV connector is filling asynchronously
    (another engine's prefill, pulled across); the scheduler skips it until the load is reported done.
    """

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the finished states."""
        return status.value.startswith("finished")


@checked(inline=True)  # every request of every step is built here: its checks are written into __init__
class Request:
    """Token ids, progress and block hashes of one request.

    ``block_hashes`` holds one chained hash per *full* block of ``all_token_ids``. The
    ``KVCacheManager`` fills it the first time it sees the request and installs its hasher,
    so ``append_output_token_ids`` extends it whenever a block fills up (vLLM passes the
    hasher to the constructor; kvlab lets the manager that owns the hash seed provide it).
    """

    #: The undo journals of the steps in progress (``open_journal``), by the id of the scheduler each one serves.
    _journals: ClassVar[dict[int, Journal]] = {}

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_features: Sequence[MultiModalFeatureSpec] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise KvlabValueError(f"request_id must be a non-empty string, got {request_id!r}")
        tokens = list(prompt_token_ids)  # its items were checked at the door (@checked: Sequence[int])
        if not tokens:
            raise KvlabValueError(f"prompt_token_ids of request {request_id!r} must hold at least one token")
        for name, value in (("cache_salt", cache_salt), ("lora_name", lora_name), ("lora_path", lora_path)):
            if value is not None and (not isinstance(value, str) or not value):
                raise KvlabValueError(f"{name} must be None or a non-empty string, got {value!r}")
        if lora_path is not None and lora_name is None:
            raise KvlabValueError("lora_path needs a lora_name: a path alone names no adapter")
        features = sorted(mm_features, key=lambda f: f.mm_position.offset)
        for feature in features:
            if not isinstance(feature, MultiModalFeatureSpec):
                raise KvlabValueError(f"mm_features must hold MultiModalFeatureSpec items, got {feature!r}")
            if feature.mm_position.offset + feature.mm_position.length > len(tokens):
                raise KvlabValueError(
                    f"multimodal item {feature.identifier!r} ends at token "
                    f"{feature.mm_position.offset + feature.mm_position.length}, past the prompt's {len(tokens)}"
                )
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(tokens)
        self._all_token_ids: list[int] = tokens
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.lora_path = lora_path if lora_path is not None else lora_name
        self.mm_features: tuple[MultiModalFeatureSpec, ...] = tuple(features)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        self._block_hasher: Callable[[Request], list[bytes]] | None = None
        self._hasher_owner: object | None = None

    # ----------------------------------------------------------------- tokens

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Prompt then output tokens (a copy: append with ``append_output_token_ids``)."""
        return tuple(self._all_token_ids)

    @checked
    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens ``start .. end - 1`` without copying the whole sequence (one block, say)."""
        return tuple(self._all_token_ids[start:end])

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The tokens generated so far."""
        return tuple(self._all_token_ids[len(self.prompt_token_ids):])

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: everything whose KV the request will need."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens; hashes every block they complete (once a manager has seen the request)."""
        new = [token_ids] if type(token_ids) is int and 0 <= token_ids < 2**63 else _token_list(token_ids)
        if self.status in FINISHED:
            raise RequestStateError(f"request {self.request_id!r} is {self.status.value}: it takes no more tokens")
        self._all_token_ids.extend(new)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    # ----------------------------------------------------------------- state

    def is_finished(self) -> bool:
        """True once the request stopped, hit its length cap or was aborted."""
        return self.status in FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), "
            f"computed={self.num_computed_tokens}, full blocks hashed={len(self.block_hashes)}, "
            f"{self.status.value})"
        )


# ----------------------------------------------------------------- a step's undo journal


class Journal:
    """A step's record of its requests (``kvlab.core.sched.snapshot``): each request among ``members`` notes its
    state here before its first change in the step, so the record costs the requests the step touches, not
    the queue that waits.

    A request's lists are changed in place (``append_output_token_ids``, the manager's block hashes) only
    after the step set one of its attributes (``num_computed_tokens``, ``status``, the hasher), so noting it
    at its first attribute write keeps its lists as they were too.
    """

    def __init__(self, members: set[int]) -> None:
        self.members = members  # ids of the requests the snapshot found
        self.noted: dict[int, tuple[Request, dict[str, Any], list[tuple[Any, Any]]]] = {}

    def note(self, request: Request) -> None:
        """Keep ``request``'s attributes, and a copy of each list, dict or set among them (changed in place)."""
        attrs = dict(vars(request))
        contents = [(value, value.copy()) for value in attrs.values() if type(value) in (list, dict, set)]
        self.noted[id(request)] = (request, attrs, contents)

    def restore(self) -> None:
        """Put every noted request back as it was before its first change (its containers refilled in place)."""
        for request, attrs, contents in self.noted.values():
            for container, saved in contents:
                if type(container) is list:
                    container[:] = saved
                else:
                    container.clear()
                    container.update(saved)
            vars(request).clear()
            vars(request).update(attrs)


def _note_then_set(request: Request, name: str, value: object) -> None:
    """``Request.__setattr__`` while a journal is open: a request some journal watches notes itself there before
    its first change, then the attribute is set."""
    key = id(request)
    for journal in Request._journals.values():
        if key in journal.members and key not in journal.noted:
            journal.note(request)
    object.__setattr__(request, name, value)


def open_journal(owner: object, members: set[int]) -> Journal:
    """Start the undo journal of ``owner``'s step (a fresh one replaces any an interrupt left open) over the
    requests whose ids are ``members``; while any is open, requests note themselves before a change."""
    journal = Request._journals[id(owner)] = Journal(members)
    Request.__setattr__ = _note_then_set  # type: ignore[method-assign]
    return journal


def close_journal(owner: object, journal: Journal) -> None:
    """End ``journal`` (the step succeeded, or was undone); the last one closed makes writes plain again."""
    if Request._journals.get(id(owner)) is journal:
        del Request._journals[id(owner)]
    if not Request._journals and "__setattr__" in Request.__dict__:
        del Request.__setattr__


#: The finished states, for a quick membership test (a tuple: members compare by identity, in C).
FINISHED = tuple(s for s in RequestStatus if RequestStatus.is_finished(s))


def _token_list(token_ids: object) -> list[int]:
    """``append_output_token_ids``'s argument as a checked list: one token id, or an iterable of them."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (int, Iterable)):
        raise KvlabValueError(f"token_ids must be a token id or an iterable of them, got {token_ids!r}")
    new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
    _check_token_ids("token_ids", new)
    return new  # type: ignore[return-value]


def _check_token_ids(name: str, tokens: Sequence[object]) -> None:
    """Every token id a non-negative int below 2**63 (bools refused): one C-level pass for plain ints."""
    if not tokens or (set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < 2**63):
        return
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**63:
            raise KvlabValueError(f"{name} must hold non-negative integer token ids, got {t!r}")
