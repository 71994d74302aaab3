"""The executor: one ``SchedulerOutput`` in, the forward pass on the paged cache, sampled tokens out.

Mirrors the job of vLLM's ``GPUModelRunner.execute_model``, much reduced: apply the step's changes to
the persistent batch (``kvlab.engine.input_batch.InputBatch``: block tables kept from step to step,
written only where a request got new blocks), copy blocks the scheduler asked for (copy-on-write),
build the step's flat batch from it (``prepare_inputs``: token ids, positions, slot mapping, block
tables, sequence lengths and query start locations, in numpy, no Python loop over tokens), run the
model, compute logits only at each request's last token, and sample them all at once. A request that
cannot be sampled (``RequestFailedError``: non-finite logits; or any other exception its sampling
raises) goes into the output's ``errors``, and the rest of the batch is sampled as usual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvlab import kernels
from kvlab.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvlab.core.sequence import BlockCopy
from kvlab.engine.attention import Attention, AttentionMetadata
from kvlab.engine.input_batch import InputBatch, StepInputs
from kvlab.engine.kv_cache_interface import KVCache, layer_tensors
from kvlab.engine.kv_connector_model_runner import kv_connector_step, kv_layer_names
from kvlab.engine.mla import MLAAttention
from kvlab.engine.sampler import Sampler
from kvlab.errors import KvlabValueError
from kvlab.kernels.checks import check_num_kv_splits


def prepare_inputs(
    scheduler_output: SchedulerOutput, block_size: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | tuple[AttentionMetadata, ...]]:
    """``input_ids [num_tokens]``, ``positions [num_tokens]`` and the attention metadata of one step, on ``device``.

    A batch of its own: every request must send its whole block table (``ScheduledRequest.whole_table``,
    as in a first step); the model runner keeps its tables from step to step instead (``InputBatch``).
    Token ``j`` of request ``i`` sits at position ``num_computed_tokens + j`` and its K/V go to
    ``slot_mapping`` of that position through the request's block table. Block-table rows
    are padded with block 0, the null block, which no kernel reads past ``seq_lens``. With
    several KV cache groups each has its own block tables, hence its own ``slot_mapping`` and
    ``block_table``: the metadata is then one per group (``seq_lens`` and ``query_start_loc`` shared).
    """
    batch = InputBatch(len(scheduler_output.scheduled[0].new_block_ids))
    batch.update(scheduler_output)
    return build_inputs(batch.prepare(scheduler_output, block_size), device)


def build_inputs(step: StepInputs, device: str | torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | tuple[AttentionMetadata, ...]]:
    """The step's tensors on ``device``, with the host copies the kernels' checks read (no device sync)."""
    seq_lens_cpu = step.tensor(step.seq_lens)  # [num_seqs], kept on the host for the checks
    query_start_loc_cpu = step.tensor(step.query_start_loc)  # [num_seqs + 1]
    seq_lens_t, query_start_loc_t = seq_lens_cpu.to(device), query_start_loc_cpu.to(device)
    metadata = []
    for table, slots in zip(step.block_tables, step.slot_mappings, strict=True):
        table_cpu = step.tensor(table)  # [num_seqs, max_blocks_per_seq]
        slots_cpu = step.tensor(slots)  # [num_tokens]
        metadata.append(AttentionMetadata(
            slot_mapping=slots_cpu.to(device),
            block_table=table_cpu.to(device),
            seq_lens=seq_lens_t,
            query_start_loc=query_start_loc_t,
            host=kernels.HostMetadata(seq_lens_cpu, table_cpu, query_start_loc_cpu),
            slot_mapping_cpu=slots_cpu,
        ))
    input_ids_t = step.tensor(step.token_ids).to(device)  # [num_tokens]
    positions_t = step.tensor(step.positions).to(device)  # [num_tokens]
    return input_ids_t, positions_t, metadata[0] if len(metadata) == 1 else tuple(metadata)


def copy_blocks(kv_caches: Sequence[KVCache], blocks_to_copy: Sequence[BlockCopy]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's cache (the physical side of copy-on-write).

    A layer's cache is its K and V, or MLA's one latent tensor; every tensor is indexed by block first.
    """
    if not blocks_to_copy:
        return
    device = layer_tensors(kv_caches[0])[0].device
    src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.int64, device=device)
    unique = {id(t): t for kv_cache in kv_caches for t in layer_tensors(kv_cache)}.values()  # groups share
    for cache in unique:  # [num_blocks, block_size, ...]
        cache[dst] = cache[src]


class ModelRunner:
    """Runs a model (``LlamaForCausalLM``, ``DeepseekV2ForCausalLM``) on the paged cache for each scheduled step.

    With ``keep_logits`` it records, per request, the logits row each sampled token came from
    (to compare an FP8 cache with a full-precision one, say), copied to the CPU.
    The step's small tensors are built on the device of ``kv_caches``, where the model runs.

    Two knobs of kvlab's own (vLLM picks both inside its attention backend) steer the kernel, so
    that a tiny model still exercises its hard paths: ``kernel_config`` fixes the tile sizes of
    every step (smaller tiles: short contexts span several), and ``decode_kv_splits`` forces the
    split count of decode-only steps (split-KV, which the automatic choice never uses on a CPU).
    Both may be set on a running engine (``engine.model_runner.kernel_config = ...``); they are
    handed to every paged attention layer of the model (``Attention``, or ``MLAAttention``, whose
    decode kernel serves one query token per sequence: its ``kernel_config`` has ``block_q`` 1 and
    ``block_m`` heads per program). ``attention_backend`` (which kernels an ``Attention`` layer calls:
    ``kvlab.engine.attention.BACKEND_KERNELS``) is handed to the ``Attention`` layers; MLA keeps its
    own kernels. ``layer_groups[i]`` is the KV cache group of layer ``i`` (a hybrid model's: each layer
    reads its group's block tables); by default one group.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], block_size: int,
                 keep_logits: bool = False, kernel_config: kernels.KernelConfig | None = None,
                 decode_kv_splits: int | None = None, layer_groups: Sequence[int] | None = None,
                 attention_backend: str = "triton") -> None:
        self.model = model
        self.layer_groups = None if layer_groups is None else tuple(layer_groups)
        self.kv_caches = kv_caches
        self.device = layer_tensors(kv_caches[0])[0].device
        self.block_size = block_size
        self.sampler = Sampler()
        self.keep_logits = keep_logits
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.kernel_config = kernel_config
        self.decode_kv_splits = decode_kv_splits
        for layer in self._attention_layers():
            if isinstance(layer, Attention):  # MLA layers keep their own kernels (kvlab.kernels.mla_decode)
                layer.attention_backend = attention_backend
        self.attention_backend = attention_backend
        self._input_batch: InputBatch | None = None

    @property
    def kernel_config(self) -> kernels.KernelConfig | None:
        """The tiles every step's attention kernel uses (None: chosen per step by ``kernels.choose_config``)."""
        return self._kernel_config

    @kernel_config.setter
    def kernel_config(self, config: kernels.KernelConfig | None) -> None:
        if config is not None and not isinstance(config, kernels.KernelConfig):
            raise KvlabValueError(f"kernel_config must be a kvlab.kernels.KernelConfig or None, got {config!r}")
        if config is not None and config.block_q != 1 and any(isinstance(m, MLAAttention)
                                                               for m in self._attention_layers()):
            raise KvlabValueError(
                f"kernel_config.block_q={config.block_q}: this model's MLA decode kernel serves one query token per "
                "sequence, so block_q must be 1 (block_m is the number of heads per program)"
            )
        self._kernel_config = config
        for layer in self._attention_layers():
            layer.kernel_config = config

    @property
    def decode_kv_splits(self) -> int | None:
        """The split count forced on decode-only steps (None: chosen, which on a CPU means 1)."""
        return self._decode_kv_splits

    @decode_kv_splits.setter
    def decode_kv_splits(self, splits: int | None) -> None:
        self._decode_kv_splits = check_num_kv_splits(splits, "decode_kv_splits")
        for layer in self._attention_layers():
            layer.decode_kv_splits = self._decode_kv_splits

    def _attention_layers(self) -> list[Attention | MLAAttention]:
        """Every paged attention layer of the model (the knobs above are handed to each)."""
        return [m for m in self.model.modules() if isinstance(m, Attention | MLAAttention)]

    #: A KV connector's worker half (``kvlab.distributed.kv_transfer``), set by ``LLMEngine``; None: no connector.
    kv_connector: Any = None

    @property
    def input_batch(self) -> InputBatch:
        """The persistent batch: every running request's block tables, one per KV cache group."""
        if self._input_batch is None:
            self._input_batch = InputBatch(1 if self.layer_groups is None else max(self.layer_groups) + 1)
        return self._input_batch

    def prepare_inputs(self, scheduler_output: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | tuple[AttentionMetadata, ...]]:
        """The step's inputs from the persistent batch (already updated with the step's new block ids)."""
        return build_inputs(self.input_batch.prepare(scheduler_output, self.block_size), self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Update the persistent batch, copy blocks, run the forward over the flat batch, sample where asked; with
        a KV connector, its loads, saves and report around that (``kvlab.engine.kv_connector_model_runner``)."""
        if self.kv_connector is None:
            return self._execute_model(scheduler_output)
        layers = dict(zip(kv_layer_names(len(self.kv_caches)), self.kv_caches, strict=True))
        with kv_connector_step(self.kv_connector, scheduler_output, layers) as kv_connector_output:
            output = self._execute_model(scheduler_output)
        return dataclasses.replace(output, kv_connector_output=kv_connector_output)

    @torch.inference_mode()
    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.drop(scheduler_output.finished_req_ids)
        self.input_batch.update(scheduler_output)
        copy_blocks(self.kv_caches, scheduler_output.blocks_to_copy)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput({})
        input_ids, positions, metadata = self.prepare_inputs(scheduler_output)
        per_layer = metadata if isinstance(metadata, AttentionMetadata) else \
            [metadata[g] for g in self.layer_groups or [0] * len(self.kv_caches)]
        first = metadata if isinstance(metadata, AttentionMetadata) else metadata[0]
        hidden_states = self.model(input_ids, positions, self.kv_caches, per_layer)  # [num_tokens, hidden]
        if hidden_states.shape[0] != first.num_seqs:  # else one token each (decodes): every row is sampled
            hidden_states = hidden_states[first.logits_indices]  # [num_seqs, hidden]
        logits = self.model.compute_logits(hidden_states)  # [num_seqs, vocab]
        return self.sample(logits, scheduler_output)

    def sample(self, logits: torch.Tensor, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Every request that samples this step (forked samples from their parent's row), in one batched call."""
        rows, wanted = [], []
        for i, s in enumerate(scheduler_output.scheduled):
            if s.sample:  # else a prefill chunk that does not reach the prompt's end
                for request_id, params in ((s.request_id, s.sampling_params), *s.forked):
                    rows.append(i)
                    wanted.append((request_id, params))
        sampled, errors = self.sampler.sample_batch(logits, rows, wanted)
        if self.keep_logits:
            for row, (request_id, _) in zip(rows, wanted, strict=True):
                self.logits.setdefault(request_id, []).append(logits[row].to("cpu", copy=True))
        return ModelRunnerOutput(sampled, errors)
