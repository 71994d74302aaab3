"""The mutation suite's catalogue: one plausible bug per entry, in every layer of kvlab.

Each mutant is an exact text replacement in one source file: ``original`` must occur exactly once
in ``path`` (relative to the repository root), or the mutant is stale and the runner refuses it
(``tests/test_mutants.py`` checks every anchor in ``make test``, so a refactor that moves one fails
CI and gets the anchor refreshed, instead of silently disabling the mutant). The kernel mutants are
``kvlab.kernels.mutants.MUTANTS`` (notebook 05 breaks its kernel with them), read from
``kernels/mutants.py`` itself, so they are written once; ``KERNEL_HINTS`` only says where each is
likely caught. ``notebooks`` and ``tests`` are hints, run first: a mutant's run stops at its first
failure, and the hint is where the bug's idea is taught or tested. This file imports no kvlab.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One bug: in ``path``, the text ``original`` (exactly once) becomes ``mutated``."""

    name: str
    layer: str            # capacity, core, sim, kernels, engine, distributed, fleet, exercises, viz
    path: str             # relative to the repository root
    original: str
    mutated: str
    bug: str              # what the broken code believes, in a learner's words
    notebooks: tuple[str, ...] = ()   # notebook numbers to run first ("03")
    tests: tuple[str, ...] = ()       # test files to run first, after the notebooks


class StaleMutantError(Exception):
    """A mutant's original text no longer occurs exactly once in its file: refresh its anchor."""


def apply(mutant: Mutant, text: str) -> str:
    """``text`` (the current source of ``mutant.path``) with the mutant's one change; stale anchors raise."""
    count = text.count(mutant.original)
    if count != 1:
        raise StaleMutantError(
            f"mutant {mutant.name!r} is stale: its original text occurs {count} times in {mutant.path} (it must "
            f"occur exactly once; refresh the anchor in scripts/mutation_catalogue.py or kernels/mutants.py): "
            f"{mutant.original!r}")
    return text.replace(mutant.original, mutant.mutated)


# ----------------------------------------------------------------- the kernels: kvlab.kernels.mutants

#: Where each kernel mutant of ``kernels/mutants.py`` is likely caught (every one must have an entry).
KERNEL_HINTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "no_rescale": (("05", "06"), ("tests/test_kernels_verify.py", "tests/test_kernels_attention.py")),
    "no_empty_row_guard": (("05", "06"), ("tests/test_kernels_verify.py", "tests/test_kernels_attention.py")),
    "causal_off_by_one": (("05", "06"), ("tests/test_kernels_attention.py",)),
    "gqa_head_mapping": (("05", "06"), ("tests/test_kernels_attention.py",)),
    "tile_to_block": (("05", "06"), ("tests/test_kernels_verify.py",)),
    "merge_weights": (("05", "06"), ("tests/test_kernels_attention.py",)),
    "fp8_scale_direction": (("05", "06"), ("tests/test_kernels_fp8.py", "tests/test_kernels_attention.py")),
    "cache_write_offset": (("05", "06"), ("tests/test_kernels_cache_write.py",)),
    "window_off_by_one": (("05", "01"), ("tests/test_kernels_window.py",)),
    "mla_rope_dropped": (("09", "05"), ("tests/test_kernels_mla.py", "tests/engine/test_mla_generate.py")),
    "mla_latent_write_offset": (("09", "05"), ("tests/test_kernels_mla_cache_write.py",
                                               "tests/engine/test_mla_generate.py")),
}


def kernel_mutants(root: Path = ROOT) -> list[Mutant]:
    """The mutants of ``kernels/mutants.py`` (read from its source, not imported), with their hints."""
    tree = ast.parse((root / "kernels" / "mutants.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Mutant" and len(node.args) == 5:
            name, module, original, mutated, bug = (ast.literal_eval(a) for a in node.args)
            notebooks, tests = KERNEL_HINTS.get(name, ((), ()))
            found.append(Mutant(name, "kernels", f"kernels/{module}.py", original, mutated, bug, notebooks, tests))
    return found


# ----------------------------------------------------------------- everything else

_CORE = "kvlab/core"
OTHER_MUTANTS: list[Mutant] = [
    # --- the cache write: slot -> (block, offset)
    Mutant("slot_mapping_block_size", "core", f"{_CORE}/sequence.py",
           "slots.append(table[pos // block_size] * block_size + pos % block_size)",
           "slots.append(table[pos // block_size] + pos % block_size)",
           "a slot is the block id plus the offset (no need to multiply by the block size)",
           ("03", "06"), ("tests/test_sequence.py",)),
    # --- the block pool
    Mutant("free_order_head_first", "core", f"{_CORE}/single_type_kv_cache_manager.py",
           "self.block_pool._free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
           "self.block_pool._free_blocks(self.pop_blocks_for_free(request_id))",
           "a request's blocks can be freed in table order (so its prompt start is evicted first)",
           ("04", "03"), ("tests/test_manager.py",)),
    Mutant("lifo_lru_swapped", "core", f"{_CORE}/block_pool.py",
           "(first if block._block_hash is None or not self.enable_caching else last).append(block)",
           "(last if block._block_hash is None or not self.enable_caching else first).append(block)",
           "cached blocks go to the head of the free queue and uncached ones to the tail",
           ("03", "04"), ("tests/test_blocks.py",)),
    Mutant("null_block_handed_out", "core", f"{_CORE}/block_pool.py",
           "self.null_block = self.free_block_queue.popleft()",
           "self.null_block = self.free_block_queue.fake_free_list_head.next_free_block",
           "reserving the null block only needs a name for it; it may stay in the free queue",
           ("03", "02"), ("tests/test_blocks.py",)),
    Mutant("eviction_keeps_hash", "core", f"{_CORE}/block_pool.py",
           "self.cached_block_hashes_by_block):\n                self._evict(block)",
           "self.cached_block_hashes_by_block):\n                pass",
           "a cached block reused for new tokens can keep its old hash in the index",
           ("04", "03"), ("tests/test_blocks.py", "tests/test_manager.py")),
    Mutant("touch_leaves_in_queue", "core", f"{_CORE}/block_pool.py",
           "queue.remove(block)",
           "pass",
           "a prefix hit on a free cached block only needs a reference; it can stay in the free queue",
           ("04", "03"), ("tests/test_blocks.py", "tests/test_manager.py")),
    # --- hashing
    Mutant("hash_parent_ignored", "core", f"{_CORE}/hashing.py",
           "return hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys))",
           "return hash_function((NONE_HASH, tuple(curr_block_token_ids), extra_keys))",
           "a block's hash need only cover its own tokens, not the prefix before it",
           ("04",), ("tests/test_hashing.py",)),
    Mutant("partial_block_hashed", "core", f"{_CORE}/hashing.py",
           "while start_token_idx + hash_block_size <= num_tokens:",
           "while start_token_idx < num_tokens:",
           "the last, partly filled block can be hashed too",
           ("04",), ("tests/test_hashing.py", "tests/test_manager.py")),
    Mutant("extra_keys_dropped", "core", f"{_CORE}/hashing.py",
           "tokens[start_token_idx:end_token_idx], extra_keys)",
           "tokens[start_token_idx:end_token_idx])",
           "the tokens alone decide a block's KV (no LoRA, image or salt in the hash)",
           ("04", "06"), ("tests/test_hashing.py",)),
    Mutant("salt_ignored", "core", f"{_CORE}/hashing.py",
           "if start == 0 and request.cache_salt:",
           "if start > 0 and request.cache_salt:",
           "the salt goes on the blocks after the first, so two tenants still share their first block",
           ("04", "06"), ("tests/test_hashing.py", "tests/engine/test_engine_tenants.py")),
    # --- the KV cache manager
    Mutant("hit_not_capped", "core", f"{_CORE}/kv_cache_manager.py",
           "limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length",
           "limit = request.num_tokens if max_cache_hit_length is None else max_cache_hit_length",
           "a fully cached prompt can hit every token (nothing is left to compute its last logits)",
           ("04", "06"), ("tests/test_manager.py",)),
    Mutant("cow_never_copies", "core", f"{_CORE}/manager_fork.py",
           "blocks[index].ref_cnt == 1 or self._is_retained(blocks[index])",
           "blocks[index].ref_cnt >= 1 or self._is_retained(blocks[index])",
           "a forked request may write into the partly filled block it shares",
           ("06", "03"), ("tests/test_manager_fork.py",)),
    # --- sliding windows and the hybrid coordinator
    Mutant("window_skips_one_short", "core", f"{_CORE}/single_type_kv_cache_manager.py",
           "return max(0, num_computed_tokens - self.sliding_window + 1)",
           "return max(0, num_computed_tokens - self.sliding_window)",
           "the next token sees the W tokens before it, so only those before them can be freed",
           ("08",), ("tests/test_sliding_window_manager.py", "tests/test_hybrid_manager.py")),
    Mutant("hybrid_full_hit_not_trimmed", "core", f"{_CORE}/kv_cache_coordinator.py",
           "del blocks_by_group[group_id][cdiv(hit_length, self.block_size):]  # type: ignore[index]",
           "pass",
           "the full-attention group keeps its whole hit, even where the sliding-window group agreed on less",
           ("08",), ("tests/test_hybrid_manager.py", "tests/test_sliding_window_manager.py")),
    # --- the scheduler
    Mutant("preempt_oldest", "core", f"{_CORE}/sched/scheduler.py",
           "victim = self.running.pop()",
           "victim = self.running.pop(0)",
           "when blocks run out, preempt the oldest running request",
           ("06", "07"), ("tests/test_scheduler.py",)),
    Mutant("no_reset_computed", "core", f"{_CORE}/sched/scheduler.py",
           "        request.num_computed_tokens = 0\n        request.num_preemptions += 1",
           "        request.num_preemptions += 1",
           "a preempted request keeps its num_computed_tokens (its blocks are freed, but it still counts them)",
           ("06", "07"), ("tests/test_scheduler.py",)),
    Mutant("resumed_sends_new_blocks_only", "core", f"{_CORE}/sched/scheduler.py",
           "whole_tables = {r.request_id for r in (*scheduled_new, *scheduled_resumed)} | self._tables_to_send",
           "whole_tables = {r.request_id for r in scheduled_new} | self._tables_to_send",
           "a request back from preemption is a running one: the executor still has its table, send the new blocks",
           ("06", "07"), ("tests/test_scheduler.py",)),
    Mutant("journal_not_written_back", "core", f"{_CORE}/sched/snapshot.py",
           "                _set_slots(block, names, values)\n",
           "                pass\n",
           "undoing a step puts the scheduler's queues back; the blocks it changed can stay as they are",
           ("06",), ("tests/test_snapshot_journal.py", "tests/test_scheduler_failures.py")),
    Mutant("request_journal_keeps_no_lists", "core", f"{_CORE}/request.py",
           "contents = [(value, value.copy()) for value in attrs.values() if type(value) in (list, dict, set)]",
           "contents = []",
           "undoing a step puts each request's numbers back; its token list and block hashes can keep what the "
           "step appended",
           ("06",), ("tests/test_snapshot_journal.py", "tests/test_scheduler_failures.py")),
    Mutant("request_never_notes_itself", "core", f"{_CORE}/request.py",
           "    Request.__setattr__ = _note_then_set  # type: ignore[method-assign]\n",
           "",
           "a step's undo record need not keep the requests: the scheduler's queues are enough",
           ("06",), ("tests/test_snapshot_journal.py", "tests/test_scheduler_failures.py")),
    Mutant("sample_every_chunk", "core", f"{_CORE}/sched/scheduler.py",
           "sample = request.num_computed_tokens == request.num_tokens",
           "sample = num_new > 0",
           "every scheduled chunk samples a token, also a prefill chunk before the prompt is complete",
           ("06",), ("tests/test_scheduler.py",)),
    # --- the budget and the bytes
    Mutant("budget_null_block", "capacity", "kvlab/capacity/budget.py",
           "num_usable = max(num_blocks - 1, 0)",
           "num_usable = max(num_blocks, 0)",
           "every block of the pool holds KV (block 0, the null block, too)",
           ("02", "07"), ("tests/test_budget.py",)),
    Mutant("budget_gb_not_gib", "capacity", "kvlab/capacity/budget.py",
           "return round(number * GiB)",
           "return round(number * 10**9)",
           "a GiB is 10**9 bytes",
           ("02", "07"), ("tests/test_budget.py",)),
    Mutant("mla_counted_as_kv", "capacity", "kvlab/capacity/models.py",
           'return 1 if self.attention == "mla" else 2',
           "return 2",
           "every attention stores a K and a V, MLA too (its latent counted twice)",
           ("01",), ("tests/test_sizing.py", "tests/test_models.py")),
    # --- a simulation
    Mutant("first_fit_exact_hole", "sim", "kvlab/sim/fragmentation_fast.py",
           "if hole[1] >= length:",
           "if hole[1] > length:",
           "a request fits a hole only if the hole is larger than the request",
           ("02",), ("tests/test_fragmentation.py",)),
    # --- the engine
    Mutant("engine_seq_lens_no_context", "engine", "kvlab/engine/input_batch.py",
           "(num_computed + num_scheduled).astype(np.int32)",
           "num_scheduled.astype(np.int32)",
           "a sequence's length is the tokens of this step (its cached context forgotten)",
           ("06",), ("tests/engine/test_engine_generate.py",)),
    Mutant("append_overwrites_table", "engine", "kvlab/engine/input_batch.py",
           "start = int(self.num_blocks_per_row[row]) if row < len(self.num_blocks_per_row) else 0",
           "start = 0",
           "a step's new block ids are the request's table (they overwrite its first blocks, not follow them)",
           ("06",), ("tests/engine/test_engine_generate.py",)),
    Mutant("engine_copy_direction", "engine", "kvlab/engine/model_runner.py",
           "        cache[dst] = cache[src]",
           "        cache[src] = cache[dst]",
           "a block copy goes from the destination to the source",
           ("06",), ("tests/engine/test_engine_generate.py",)),
    # --- Gemma 3's decoder
    Mutant("gemma3_window_on_global_layers", "engine", "kvlab/engine/gemma3.py",
           "sliding_window=config.layer_sliding_window(layer),",
           "sliding_window=config.sliding_window,",
           "Gemma 3's window applies to every layer, its global (full-attention) ones too",
           (), ("tests/engine/test_qwen3_gemma3_engine.py",)),
    Mutant("gemma3_norm_without_one", "engine", "kvlab/engine/gemma3.py",
           "(normed * (1.0 + self.weight.float()))",
           "(normed * self.weight.float())",
           "a Gemma norm scales by its weight, as Llama's does (the checkpoint stores the offset from 1)",
           (), ("tests/engine/test_qwen3_gemma3_engine.py",)),
    Mutant("gemma3_one_rope_base", "engine", "kvlab/engine/gemma3.py",
           "rope=config.layer_rope(layer), norm=GemmaRMSNorm)",
           "rope=config.rope, norm=GemmaRMSNorm)",
           "Gemma 3's sliding layers rotate with the global layers' base (rope_local_base_freq ignored)",
           (), ("tests/engine/test_qwen3_gemma3_engine.py",)),
    # --- tensor parallelism (notebook 11)
    Mutant("tp_kv_replica_interleaved", "engine", "kvlab/engine/linear.py",
           "        self.shard_rank = self.tp_rank // num_replicas",
           "        self.shard_rank = self.tp_rank % self.num_shards",
           "with fewer KV heads than ranks, rank r loads KV head r mod Hkv (not the head its query heads read)",
           ("11",), ("tests/engine/test_parallel_layers.py", "tests/engine/test_tensor_parallel.py")),
    Mutant("tp_row_shard_offset", "engine", "kvlab/engine/linear.py",
           "                                   (output_size, input_size), 1, self.tp_rank)",
           "                                   (output_size, input_size), 1, 0)",
           "every rank of a row-parallel layer loads the first columns (the offset of its shard forgotten)",
           ("11",), ("tests/engine/test_parallel_layers.py", "tests/engine/test_tensor_parallel.py")),
    Mutant("tp_no_all_reduce", "engine", "kvlab/engine/linear.py",
           "            output = self.tp_group.all_reduce(output)",
           "            output = output",
           "a row-parallel layer's partial sum is the answer: no all-reduce after o_proj and down_proj",
           ("11",), ("tests/engine/test_tensor_parallel.py",)),
    # --- the fleet's routers
    Mutant("cache_aware_either_threshold", "fleet", "kvlab/fleet/routers.py",
           "                and max(loads) > self.balance_rel_threshold * min(loads))",
           "                or max(loads) > self.balance_rel_threshold * min(loads))",
           "SGLang's router balances load when either threshold is passed (it needs both)",
           (), ("tests/test_fleet_routers.py",)),
    Mutant("precise_index_keeps_removed", "fleet", "kvlab/fleet/routers.py",
           "            for h in event.block_hashes:\n                self._drop(replica, h)",
           "            for h in ():\n                self._drop(replica, h)",
           "an event-fed index can ignore BlockRemoved: a block once stored stays a hit",
           ("10",), ("tests/test_fleet_routers.py", "tests/test_fleet_simulation.py")),
    Mutant("dynamo_ignores_overlap", "fleet", "kvlab/fleet/routers.py",
           "self.overlap_weight * (len(hashes) - overlaps.get(i, 0))",
           "self.overlap_weight * len(hashes)",
           "Dynamo's cost counts every prompt block as prefill, cached or not",
           (), ("tests/test_fleet_routers.py",)),
    Mutant("approximate_forgets_its_routing", "fleet", "kvlab/fleet/routers.py",
           "            self.index.apply(replica, _Stored((h,)))",
           "            pass",
           "llm-d's approximate router does not record where it sent a prompt: its index stays empty",
           ("10",), ("tests/test_fleet_routers.py",)),
    Mutant("precise_tie_among_all", "fleet", "kvlab/fleet/routers.py",
           "replica = self._rng.choice([i for i in scores if scores[i] == scores[replica]])",
           "replica = self._rng.choice(list(scores))",
           "the random tie-break picks among every replica, not only the tied best ones",
           ("10",), ("tests/test_fleet_routers.py",)),
    Mutant("engine_publishes_empty_batches", "engine", "kvlab/engine/llm_engine.py",
           "self.kv_event_publisher.publish(make_batch(events))",
           "self.kv_event_publisher.publish(make_batch([]))",
           "the engine publishes a batch per step but leaves its pool's events out of it",
           ("10",), ("tests/engine/test_engine_kv_events.py",)),
    # --- KV connectors: prefill and decode apart (notebook 11, part 2)
    Mutant("pull_block_off_by_one", "distributed",
           "kvlab/distributed/kv_transfer/kv_connector/v1/p2p_gloo_connector.py",
           "        index = torch.tensor(local, dtype=torch.int64)\n",
           "        index = torch.tensor([b + 1 for b in local], dtype=torch.int64)\n",
           "the decode engine writes a pulled block into the block after the one its scheduler allocated",
           ("11",), ("tests/engine/test_kv_transfer.py",)),
    Mutant("pull_skips_partial_block", "distributed",
           "kvlab/distributed/kv_transfer/kv_connector/v1/p2p_gloo_connector.py",
           "            target.index_copy_(0, index.to(tensor.device), blocks)",
           "            keep = len(index) - (params['remote_num_tokens'] % tensor.shape[1] > 0)\n"
           "            target.index_copy_(0, index[:keep].to(tensor.device), blocks[:keep])",
           "only whole blocks need to cross: the prompt's partial last block is left behind",
           ("11",), ("tests/engine/test_kv_transfer.py",)),
    Mutant("pull_heads_not_resliced", "distributed",
           "kvlab/distributed/kv_transfer/kv_connector/v1/p2p_gloo_connector.py",
           "                target = tensor[:, :, source.local_start:source.local_start + source.count]",
           "                target = tensor[:, :, source.remote_start:source.remote_start + source.count]",
           "a producer rank's KV heads land where they sat on that rank, not at their place among the consumer's "
           "heads (every rank writes head 0)",
           ("11",), ("tests/engine/test_kv_transfer.py",)),
    Mutant("loaded_prompt_not_recomputed", "core", "kvlab/core/sched/scheduler.py",
           "        if request.num_computed_tokens == request.num_tokens:\n"
           "            request.num_computed_tokens = request.num_tokens - 1\n",
           "",
           "a prompt whose KV arrived whole needs no token computed before the first sample",
           ("11",), ("tests/test_kv_connector_scheduler.py", "tests/engine/test_kv_transfer.py")),
    # --- the grader and a panel
    Mutant("grader_tolerance", "exercises", "kvlab/exercises/canonical.py",
           "return math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-12)",
           "return math.isclose(expected, actual, rel_tol=1e-2, abs_tol=1e-12)",
           "an answer within 1 % of the expected number is right",
           (), ("tests/test_exercises.py", "tests/test_exercises_grader.py")),
    Mutant("puzzle_ignores_stray_writes", "exercises", "kvlab/exercises/nb05_puzzles.py",
           "] if actual.outside != expected.outside else []",
           "] if False else []",
           "a puzzle kernel is right when its outputs are, whatever it wrote past a tensor's edge",
           (), ("tests/test_exercises.py",)),
    # --- the per-program view of notebook 05's puzzles
    Mutant("view_counts_masked_lanes", "kernels", "kernels/program_view.py",
           "on = tl.where(mask, on, 0)",
           "on = tl.where(mask, on, 1)",
           "a masked-off lane is an access too: the program touched every address it computed",
           ("05",), ("tests/test_kernels_program_view.py",)),
    # --- the torch attention backend's plan for decodes
    Mutant("decode_window_one_short", "kernels", "kernels/torch_attention.py",
           "inside & (keys > (lens - 1 - batch.sliding_window)[:, None])",
           "inside & (keys > (lens - batch.sliding_window)[:, None])",
           "a decode's window of W keys ends W keys before the sequence's end, the query itself not counted",
           ("08",), ("tests/test_kernels_torch_attention.py",)),
    # --- kvlab's engine batching statically, the bench's baseline for continuous batching on one engine
    Mutant("static_run_counts_padding", "engine", "kvlab/engine/throughput.py",
           "tokens = sum(min(len(engine.outputs[i]), n) for",
           "tokens = sum(max(len(engine.outputs[i]), n) for",
           "a static batch's padding steps count as tokens served, flattering the static run",
           ("06",), ("tests/test_engine_throughput.py",)),
    Mutant("budget_panel_ignores_tp", "viz", "kvlab/viz/budget.py",
           '"tp": self.tp.value,',
           '"tp": 1,',
           "the budget panel can plan one GPU whatever the TP slider says",
           ("02",), ("tests/test_viz_budget.py",)),
]


def all_mutants(root: Path = ROOT) -> list[Mutant]:
    """Every mutant of the suite: the kernels' first, then the rest."""
    return kernel_mutants(root) + OTHER_MUTANTS
