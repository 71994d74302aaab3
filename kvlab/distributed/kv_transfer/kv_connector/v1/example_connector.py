"""``ExampleConnector``: the KV cache through files, as vLLM 0.33.0's ``example_connector.py`` moves it.

The simplest thing that moves a cache between two engines: the producer saves a prompt's KV, one
safetensors file per layer (tensor ``"kv_cache"``), in a folder named by the md5 of the prompt's token ids
(int64 bytes, as ``torch.tensor(ids).numpy().tobytes()``); the consumer finds the folder, says it can load
those tokens, and loads them synchronously into its own blocks before the forward. What is saved and
matched is the prompt's first ``align_to_block_size(n)`` tokens (``(n - 1) // block_size * block_size``):
whole blocks, never the last token. The lookup aligns ``len(prompt) - 1``: vLLM's example assumes the
consumer's prompt is the producer's plus the one token the producer generated (``max_tokens=1``).

One layer's file holds ``[num_tensors, num_tokens, ...]``: its K and V at the prompt's slots (``[2, n,
num_kv_heads, head_size]``), or MLA's one latent ``[1, n, kv_lora_rank + qk_rope_head_dim]``.

Where kvlab differs: the save happens in the step where the prompt's KV is complete (vLLM's example saves
in the request's first step, which for a chunked prompt writes KV not computed yet), the hit is never
negative (vLLM's returns ``aligned - num_computed_tokens`` even below zero), and a file that is missing or
unreadable when the load runs is reported in ``get_block_ids_with_load_errors`` (the scheduler recomputes
or fails the request) instead of raising in the forward.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import torch

from kvlab.distributed.kv_transfer.kv_connector.utils import TransferTopology
from kvlab.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvlab.engine.kv_cache_interface import layer_tensors
from kvlab.engine.kv_transfer_config import KVTransferConfig


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """vLLM's helper: the whole blocks before the last of ``num_tokens`` tokens, in tokens."""
    return (num_tokens - 1) // block_size * block_size


@dataclasses.dataclass
class ReqMeta:
    """One request's load or save: the tokens (whole blocks) and the slots their KV sits in."""

    request_id: str
    token_ids: list[int]
    slot_mapping: list[int]
    is_store: bool

    @staticmethod
    def make_meta(request_id: str, token_ids: list[int], block_ids: list[int], block_size: int,
                  is_store: bool) -> ReqMeta:
        valid_num_tokens = align_to_block_size(len(token_ids), block_size)
        slots = [block_ids[i // block_size] * block_size + i % block_size for i in range(valid_num_tokens)]
        return ReqMeta(request_id, list(token_ids[:valid_num_tokens]), slots, is_store)


@dataclasses.dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = dataclasses.field(default_factory=list)


class ExampleConnector(KVConnectorBase_V1):
    """Save and load a prompt's KV as files under ``kv_connector_extra_config["shared_storage_path"]``."""

    def __init__(self, kv_transfer_config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                 topology: TransferTopology | None = None) -> None:
        super().__init__(kv_transfer_config, role, block_size, topology)
        self._storage_path = str(kv_transfer_config.get_from_extra_config("shared_storage_path", "/tmp"))
        self._requests_need_load: dict[str, Any] = {}
        self._admitted: dict[str, Any] = {}  # requests allocated this step (their prompts, for the saves)
        self._pending_stores: dict[str, Any] = {}  # requests whose prompt's KV is not complete yet
        self._kv_caches: dict[str, tuple[torch.Tensor, ...]] = {}
        self._load_errors: set[int] = set()
        self.num_files_written = 0  # kvlab's counters, for tests and notebooks
        self.num_files_read = 0

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = {name: layer_tensors(kv) for name, kv in kv_caches.items()}

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Load every request's files into its slots, layer by layer, before the forward (synchronous)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        for request in metadata.requests:
            if request.is_store:
                continue
            slots = torch.tensor(request.slot_mapping, dtype=torch.int64)
            try:
                loaded = {name: self._read(name, request.token_ids) for name in self._kv_caches}
            except (OSError, KeyError, ValueError, RuntimeError):  # missing, truncated or foreign: recompute
                self._load_errors.update(sorted({s // self._block_size for s in request.slot_mapping}))
                continue
            for name, tensors in self._kv_caches.items():
                kv = loaded[name]  # [num_tensors, num_tokens, ...]
                for i, cache in enumerate(tensors):  # [num_blocks, block_size, ...] -> one row per slot
                    cache.view(-1, *cache.shape[2:])[slots.to(cache.device)] = kv[i].to(cache.device)

    def _read(self, layer_name: str, token_ids: list[int]) -> torch.Tensor:
        import safetensors.torch

        tensors = self._kv_caches[layer_name]
        kv = safetensors.torch.load_file(self._filename(layer_name, token_ids))["kv_cache"]
        expected = (len(tensors), len(token_ids), *tensors[0].shape[2:])
        if tuple(kv.shape) != expected or kv.dtype != tensors[0].dtype:
            raise ValueError(f"{layer_name}: the file holds {tuple(kv.shape)} {kv.dtype}, expected {expected} "
                             f"{tensors[0].dtype}")
        self.num_files_read += 1
        return kv

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Write ``layer_name``'s KV at each saving request's slots to its file."""
        import safetensors.torch

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        for request in metadata.requests:
            if not request.is_store:
                continue
            tensors = layer_tensors(kv_layer)
            slots = torch.tensor(request.slot_mapping, dtype=torch.int64, device=tensors[0].device)
            kv = torch.stack([t.view(-1, *t.shape[2:])[slots] for t in tensors])  # [num_tensors, num_tokens, ...]
            os.makedirs(self._foldername(request.token_ids), exist_ok=True)
            safetensors.torch.save_file({"kv_cache": kv.detach().cpu().contiguous()},
                                        self._filename(layer_name, request.token_ids))
            self.num_files_written += 1

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ----------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt's whole blocks before its last token, if their folder exists; loaded synchronously."""
        if not self._found_match_for_prompt(request.prompt_token_ids):
            return 0, False
        num_tokens_to_check = align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)
        return max(num_tokens_to_check - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._admitted[request.request_id] = request
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        """Loads for requests admitted with a hit; saves for prompts no folder holds, once their KV is complete."""
        meta = ExampleConnectorMetadata()
        for request_id in scheduler_output.scheduled_new_req_ids:
            request = self._admitted.get(request_id)
            if request_id in self._requests_need_load:
                meta.requests.append(ReqMeta.make_meta(request_id, request.prompt_token_ids,
                                                       self._block_ids(request_id), self._block_size, False))
            elif (align_to_block_size(request.num_prompt_tokens, self._block_size)
                  and not self._found_match_for_prompt(request.prompt_token_ids)):
                self._pending_stores[request_id] = request
        for s in scheduler_output.scheduled:
            if s.request_id in scheduler_output.scheduled_resumed_req_ids and s.request_id in self._requests_need_load:
                request = self._requests_need_load[s.request_id]
                tokens = request.all_token_ids[:s.num_computed_tokens + s.num_tokens]
                meta.requests.append(ReqMeta.make_meta(s.request_id, tokens, self._block_ids(s.request_id),
                                                       self._block_size, False))
            request = self._pending_stores.get(s.request_id)
            if request is not None and s.num_computed_tokens + s.num_tokens >= request.num_prompt_tokens:
                del self._pending_stores[s.request_id]  # this step completes the prompt's KV: save it
                meta.requests.append(ReqMeta.make_meta(s.request_id, request.prompt_token_ids,
                                                       self._block_ids(s.request_id), self._block_size, True))
        self._requests_need_load.clear()
        self._admitted.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self._pending_stores.pop(request.request_id, None)
        return False, None

    def _block_ids(self, request_id: str) -> list[int]:
        return list(self._kv_cache_manager.get_block_ids_per_group(request_id)[0])

    # ----------------------------------------------------------------- files

    def _found_match_for_prompt(self, prompt_token_ids: list[int]) -> bool:
        num_tokens_to_check = align_to_block_size(len(prompt_token_ids) - 1, self._block_size)
        return num_tokens_to_check > 0 and os.path.exists(self._foldername(prompt_token_ids[:num_tokens_to_check]))

    def _foldername(self, token_ids: list[int]) -> str:
        """The folder of a token sequence: the md5 of its int64 bytes, under the storage path."""
        token_bytes = torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()
        return os.path.join(self._storage_path, hashlib.md5(token_bytes, usedforsecurity=False).hexdigest())

    def _filename(self, layer_name: str, token_ids: list[int]) -> str:
        return os.path.join(self._foldername(token_ids), f"{layer_name}.safetensors")


__all__ = ["ExampleConnector", "ExampleConnectorMetadata", "ReqMeta", "align_to_block_size"]
