"""The input sweep: every public callable of kvlab's pure layers, called with wrong types and values.

Issue 14's promise, tested over the whole API rather than function by function: bad input gets a kvlab
error naming the parameter the caller used, never a generic Python error from inside, never a silent
accept, never a hang. ``tests/_api_sweep.py`` builds the calls (see its docstring for the probes and
the outcomes). Output records that kvlab builds and returns (results, snapshots, stats) are not inputs a
learner constructs and are skipped with that reason; so are protocols and the hash functions themselves
(they take any object by design).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import _api_sweep as sweep
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RESULT = "an output record kvlab builds and returns; learners read it, never construct it"
LIVE = ("takes blocks, requests or step outputs that must come from the same live object (a pool's own blocks, "
        "an allocated request, a scheduled step; an observer's callbacks, which the pool calls; the pool's own free "
        "queue, hash index and block records, which only the pool drives): swept by the state machines in "
        "test_block_pool_state_machine.py, test_manager_state_machine.py and test_failing_calls_state_machine.py")
INSIDE = ("built by KVCacheManager from its KV cache groups, as in vLLM; swept through KVCacheManager and "
          "driven by test_hybrid_manager_state_machine.py")
SKIP: dict[str, str] = {
    **{name: RESULT for name in (
        "kvlab.capacity.budget.KVCachePlan", "kvlab.capacity.mla.MLACost", "kvlab.capacity.mla.PathCost",
        "kvlab.capacity.playbook.Decision", "kvlab.capacity.playbook.LeverResult",
        "kvlab.capacity.playbook.PlaybookResult", "kvlab.capacity.source_deployments.SourceArithmetic",
        "kvlab.capacity.source_deployments.SourceDeployment", "kvlab.capacity.startup_log.Reconstruction",
        "kvlab.capacity.startup_log.StartupLog", "kvlab.capacity.tiers.TierTable",
        "kvlab.core.cache_stats.PrefixCacheStats", "kvlab.core.kv_offload.OffloadStats",
        "kvlab.core.kv_offload.KVConnectorMetadata", "kvlab.core.kv_cache_metrics.PoolDiagnosis",
        "kvlab.core.kv_cache_metrics.Stamp", "kvlab.core.kv_cache_metrics.BlockMetricsState",
        "kvlab.core.sched.output.ModelRunnerOutput", "kvlab.core.sched.output.RequestOutput",
        "kvlab.core.sched.output.ScheduledRequest", "kvlab.core.sched.output.SchedulerOutput",
        "kvlab.core.sched.output.SchedulerStats", "kvlab.core.kv_cache_utils.KVCacheBlockCopy",
        "kvlab.sim.block_types.BlockView", "kvlab.sim.block_types.PoolSnapshot",
        "kvlab.sim.block_scenarios.Step", "kvlab.sim.collisions.BlockCollision",
        "kvlab.sim.fragmentation.FragmentationResult", "kvlab.sim.fragmentation_fast.SlotSteps",
        "kvlab.sim.prefix_sim.SimResult", "kvlab.sim.serving_sim.ChatRun", "kvlab.sim.sharing.SharingResult",
        "kvlab.capacity.hybrid.HybridKVCachePlan", "kvlab.capacity.parallel.ParallelPlan",
        "kvlab.capacity.tp_cost.TPStepCollectives",
        "kvlab.sim.hybrid_hits.HitWalkthrough",
        "kvlab.core.sched.output.KVConnectorOutput", "kvlab.sim.disaggregation.ServingResult",
        "kvlab.core.kv_cache_utils.KVCacheBlocks",
        "kvlab.core.kv_cache_events.BlockStored", "kvlab.core.kv_cache_events.BlockRemoved",
        "kvlab.core.kv_cache_events.AllBlocksCleared",
    )},
    **{name: INSIDE for name in (
        "kvlab.core.kv_cache_coordinator.HybridKVCacheCoordinator",
        "kvlab.core.kv_cache_coordinator.KVCacheCoordinator",
        "kvlab.core.kv_cache_coordinator.KVCacheCoordinatorNoPrefixCache",
        "kvlab.core.kv_cache_coordinator.UnitaryKVCacheCoordinator",
        "kvlab.core.kv_cache_coordinator.get_kv_cache_coordinator",
        "kvlab.core.single_type_kv_cache_manager.FullAttentionManager",
        "kvlab.core.single_type_kv_cache_manager.SingleTypeKVCacheManager",
        "kvlab.core.single_type_kv_cache_manager.SlidingWindowManager",
        "kvlab.core.single_type_kv_cache_manager.get_manager_for_kv_cache_spec",
        "kvlab.core.single_type_kv_cache_manager.find_longest_cache_hit",
    )},
    "kvlab.core.block_pool.BlockPoolObserver": "a protocol (an interface), not a callable",
    "kvlab.core.sched.output.Executor": "a protocol (an interface), not a callable",
    "kvlab.core.sched.output.SchedulerKVConnector": "a protocol (an interface), not a callable",
    "kvlab.sim.disaggregation.Stepper": "a protocol (an interface), not a callable",
    **{f"kvlab.sim.disaggregation.ArrivedKVConnector{m}": "a KV connector's scheduler half: the scheduler calls it "
       "with its own live requests and blocks (swept through ModelledEngine and test_kv_connector_scheduler.py)"
       for m in ("", ".get_num_new_matched_tokens", ".update_state_after_alloc", ".build_connector_meta",
                 ".update_connector_output", ".request_finished")},
    **{name: "the step's undo record, which only kvlab.core.sched.loop.step drives; swept by "
             "tests/engine/test_engine_interrupts.py (an interrupt at every line of a step)"
       for name in ("kvlab.core.sched.snapshot.Snapshot", "kvlab.core.sched.snapshot.Snapshot.restore",
                    "kvlab.core.sched.snapshot.Snapshot.close", "kvlab.core.sched.snapshot.commit",
                    "kvlab.core.kv_cache_utils.open_journal", "kvlab.core.kv_cache_utils.close_journal",
                    "kvlab.core.request.open_journal", "kvlab.core.request.close_journal", "kvlab.core.request.Journal",
                    "kvlab.core.request.Journal.note", "kvlab.core.request.Journal.restore")},
    "kvlab.core.request.RequestStatus": "an enum; its values are the input",
    **{name: LIVE for name in (
        "kvlab.core.block_pool.BlockPool.cache_full_blocks", "kvlab.core.block_pool.BlockPool.cache_partial_block",
        "kvlab.core.block_pool.BlockPool.copy_on_write", "kvlab.core.block_pool.BlockPool.free_blocks",
        "kvlab.core.block_pool.BlockPool.touch", "kvlab.core.block_pool.BlockPool.touch_and_get_new_blocks",
        *(f"kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.{m}" for m in (
            "popleft", "popleft_n", "peek_n", "get_all_free_blocks")),
        *(f"kvlab.core.block_pool.BlockHashToBlockMap.{m}" for m in (
            "get_one_block", "contain", "insert", "pop", "block_ids", "items", "values", "clear")),
        "kvlab.core.kv_cache_utils.KVCacheBlock.set_block_hash", "kvlab.core.kv_cache_utils.KVCacheBlock.reset_hash",
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.append",
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.append_n",
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.prepend_n",
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.remove",
        "kvlab.core.kv_cache_manager.KVCacheManager.cache_blocks",
        "kvlab.core.kv_cache_manager.KVCacheManager.get_block_ids",
        "kvlab.core.kv_cache_manager.KVCacheManager.get_blocks",
        "kvlab.core.kv_cache_manager.KVCacheManager.get_block_ids_per_group",
        "kvlab.core.kv_cache_manager.KVCacheManager.get_blocks_per_group",
        "kvlab.core.kv_offload.CPUOffloadingManager.swapped_blocks",
        "kvlab.core.manager_fork.ForkMixin", "kvlab.core.manager_fork.ForkMixin.fork",
        "kvlab.core.manager_fork.ForkMixin.copy_on_write",
        "kvlab.core.sched.loop.NoComputeExecutor.execute_model",
        "kvlab.core.sched.scheduler.Scheduler.fail_step", "kvlab.core.sched.scheduler.Scheduler.make_stats",
        "kvlab.core.sched.scheduler.Scheduler.update_from_output",
        "kvlab.sim.block_narration.describe", "kvlab.sim.block_narration.opening",
        "kvlab.sim.block_scenarios.pool_snapshot",
        "kvlab.sim.block_scenarios.snapshot",
        *(f"kvlab.core.{owner}.on_block_{event}"
          for owner in ("kv_cache_metrics.KVCacheMetricsCollector",
                        "kv_offload.OffloadingConnector")
          for event in ("accessed", "allocated", "evicted")),
    )},
    "kvlab.kv_cache_interface.KVCacheSpec.max_memory_usage_bytes": "abstract: each spec kind defines it (swept there)",
    "kvlab.kv_cache_interface.KVCacheSpec.max_num_blocks_per_request": "abstract: each spec kind defines it",
    "kvlab.sim.fragmentation_fast.run_fast": "simulate()'s fast path: simulate checks its inputs and is swept",
    "kvlab.engine.engine_config.derived_max_model_len": "takes the DecoderConfig EngineConfig read; swept through "
                                                         "EngineConfig",
    "kvlab.engine.engine_config.verify_max_model_len": "takes the DecoderConfig EngineConfig read; swept through "
                                                       "EngineConfig",
    **{f"kvlab.core.hashing.{name}": "a hash function: it takes any object by design"
       for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")},
}


def _overrides() -> dict[str, Any]:
    from kvlab.capacity.cost_model import cost_model
    from kvlab.capacity.hardware import get_gpu, get_host, get_link
    from kvlab.capacity.hybrid import layer_specs, plan_hybrid_kv_cache
    from kvlab.capacity.models import MODELS_DIR, get_model
    from kvlab.capacity.source_deployments import SOURCE_DEPLOYMENTS
    from kvlab.core.cache_stats import PrefixCacheStats
    from kvlab.core.hashing import get_hash_fn_by_name, init_none_hash
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.kv_cache_metrics import KVCacheMetricsCollector
    from kvlab.core.kv_cache_utils import KVCacheBlock, KVCacheBlocks
    from kvlab.core.kv_offload import CPUOffloadingManager
    from kvlab.core.request import PlaceholderRange, Request
    from kvlab.core.sched.output import GenerationRequest
    from kvlab.data import DATA_DIR
    from kvlab.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from kvlab.sim.block_scenarios import Op, get_scenario
    from kvlab.sim.disaggregation import ModelledEngine, PDWorkload
    from kvlab.sim.prefix_sim import shared_prompt_workload

    sha = get_hash_fn_by_name("sha256")
    none = init_none_hash(sha)
    SHAPE = {"num_kv_heads": 8, "head_size": 128, "dtype": "bf16"}  # noqa: N806 - a layer's shape, for the specs
    TINY = DATA_DIR / "tiny-pydoc-llama"

    def init_fields(obj: Any) -> dict[str, Any]:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}

    return {
        "kvlab.capacity.hardware.GPUSpec": lambda: init_fields(get_gpu("H100-SXM-80GB")),
        "kvlab.capacity.hybrid.describe_groups": lambda: {"plan": plan_hybrid_kv_cache(
            "gpt-oss-20b", max_model_len=8192, gpu_memory_gib=80.0)},
        "kvlab.capacity.hybrid.default_max_num_batched_tokens": lambda: {"gpu": "H100-SXM-80GB"},
        "kvlab.capacity.hybrid.get_kv_cache_groups": lambda: {"specs": layer_specs(get_model("gpt-oss-20b"))},
        "kvlab.capacity.hybrid.plan_hybrid_kv_cache": lambda: {"model": "gpt-oss-20b", "max_model_len": 8192,
                                                               "gpu_memory_gib": 80.0},
        "kvlab.core.hashing.make_block_hash_with_group_id": lambda: {"block_hash": none, "group_id": 1},
        "kvlab.core.sched.scheduler.Scheduler.check_admissible": lambda: {"request": GenerationRequest("g", [1, 2])},
        "kvlab.kv_cache_interface.KVCacheSpec.max_memory_usage_bytes": lambda: {"max_model_len": 64,
                                                                                "max_in_flight_tokens": 16},
        "kvlab.kv_cache_interface.KVCacheSpec.max_num_blocks_per_request": lambda: {"max_model_len": 64,
                                                                                    "max_in_flight_tokens": 16},
        "kvlab.kv_cache_interface.SlidingWindowSpec": lambda: {"block_size": 4, "sliding_window": 8, **SHAPE},
        "kvlab.kv_cache_interface.AttentionSpec": lambda: {"block_size": 16, **SHAPE},
        "kvlab.kv_cache_interface.FullAttentionSpec": lambda: {"block_size": 16, **SHAPE},
        "kvlab.kv_cache_interface.MLAAttentionSpec": lambda: {"block_size": 16, "head_size": 576, "dtype": "bf16"},
        "kvlab.kv_cache_interface.kv_dtype_name": lambda: {"dtype": "bfloat16"},
        "kvlab.kv_cache_interface.SlidingWindowSpec.max_admission_blocks_per_request": lambda: {
            "max_in_flight_tokens": 16, "max_model_len": 64},
        "kvlab.kv_cache_interface.SlidingWindowSpec.max_num_blocks_per_request": lambda: {
            "max_model_len": 64, "max_in_flight_tokens": 16},
        "kvlab.kv_cache_interface.KVCacheGroupSpec": lambda: {"layer_names": ("layer.0",),
                                                              "kv_cache_spec": FullAttentionSpec(block_size=4)},
        "kvlab.kv_cache_interface.KVCacheConfig": lambda: {"num_blocks": 8, "kv_cache_groups": (
            KVCacheGroupSpec(("layer.0",), FullAttentionSpec(block_size=4)),)},
        "kvlab.capacity.hardware.HostSpec": lambda: init_fields(get_host("DGX-H100")),
        "kvlab.capacity.hardware.LinkSpec": lambda: init_fields(get_link("PCIe 5.0 x16")),
        "kvlab.capacity.tp_cost.tp_step_collectives": lambda: {"model": "llama-3-70b", "tp": 8, "num_seqs": 64},
        "kvlab.capacity.models.ModelSpec": lambda: init_fields(get_model("llama-3-8b")),
        "kvlab.capacity.models.ModelSpec.from_hf_config": lambda: {"config": MODELS_DIR / "llama-3-8b.json"},
        "kvlab.capacity.config_fields.check_config_fields": lambda: {"config": dict(get_model("llama-3-8b").config)},
        "kvlab.capacity.source_deployments.source_arithmetic": lambda: {"source": SOURCE_DEPLOYMENTS["a"]},
        **{f"kvlab.core.block_pool.BlockHashToBlockMap.{m}": (lambda: {"key": none, "block_id": 1})
           for m in ("block_ids", "contain", "get_one_block", "pop")},
        "kvlab.core.block_pool.BlockHashToBlockMap.insert": lambda: {"key": none, "block": KVCacheBlock(1)},
        "kvlab.core.block_pool.BlockPool.add_observer": lambda: {"observer": KVCacheMetricsCollector()},
        "kvlab.core.cache_stats.CachingMetrics.observe": lambda: {"stats": PrefixCacheStats()},
        "kvlab.core.kv_offload.OffloadingConnector.get_num_new_matched_tokens": lambda: {
            "request": Request("r0", list(range(10))), "num_computed_tokens": 0},
        "kvlab.core.kv_offload.OffloadingConnector.update_state_after_alloc": lambda: {
            "request": Request("r0", list(range(10))), "blocks": KVCacheBlocks(((),)), "num_external_tokens": 0},
        "kvlab.core.kv_offload.OffloadingConnector.request_finished": lambda: {
            "request": Request("r0", list(range(10))), "block_ids": []},
        "kvlab.core.kv_offload.OffloadingConnector.update_connector_output": lambda: {"connector_output": None},
        **{f"kvlab.capacity.disaggregation.{name}": (lambda args=args: {
            "cost": cost_model("llama-3-8b", "H100-SXM-80GB", "Ethernet 100G"), **args})
           for name, args in (("transfer_seconds", {"prompt_tokens": 100}),
                              ("step_seconds", {"sequences": [(10, 0), (1, 20)]}),
                              ("move_or_recompute", {"num_tokens": 100}), ("crossover_tokens", {"max_tokens": 1000}))},
        "kvlab.capacity.disaggregation.kv_transfer_bytes": lambda: {"model": "llama-3-8b", "prompt_tokens": 100},
        "kvlab.engine.kv_transfer_config.KVTransferConfig.get_from_extra_config": lambda: {"key": "shared_storage_path",
                                                                                           "default": "/tmp"},
        "kvlab.sim.disaggregation.ModelledEngine": lambda: {"cost": cost_model("llama-3-8b"), "num_blocks": 64},
        "kvlab.sim.disaggregation.ModelledEngine.add": lambda: {"request_id": "r0", "prompt": [1, 2, 3],
                                                                "max_tokens": 2},
        "kvlab.sim.disaggregation.serve_colocated": lambda: {
            "make_engine": lambda: ModelledEngine(cost_model("llama-3-8b"), num_blocks=64),
            "workload": PDWorkload(prompt_tokens=16, output_tokens=2, num_requests=2)},
        "kvlab.sim.disaggregation.serve_disaggregated": lambda: {
            "make_prefill": lambda: ModelledEngine(cost_model("llama-3-8b"), num_blocks=64),
            "make_decode": lambda: ModelledEngine(cost_model("llama-3-8b"), num_blocks=64),
            "workload": PDWorkload(prompt_tokens=16, output_tokens=2, num_requests=2)},
        "kvlab.core.sched.scheduler.Scheduler.add_request": lambda: {"request": GenerationRequest("g", [1, 2])},
        "kvlab.engine.engine_config.EngineConfig": lambda: {"model_dir": TINY, "num_gpu_blocks": 16},
        "kvlab.engine.engine_config.EngineConfig.create": lambda: {"model_dir": TINY},
        "kvlab.sim.workloads.lognormal_mus": lambda: {"name": "alpaca"},
        "kvlab.units.cdiv": lambda: {"a": 7, "b": 2},
        "kvlab.units.format_bytes": lambda: {"num_bytes": 1 << 20},
        "kvlab.units.format_ranges": lambda: {"values": [0, 1, 2, 5]},
        "kvlab.capacity.budget.format_gib": lambda: {"num_bytes": 1 << 30},
        "kvlab.capacity.budget.kv_cache_capacity_line": lambda: {"num_tokens": 56320, "max_model_len": 8192,
                                                                 "max_concurrency": 6.875},
        "kvlab.capacity.budget.plan_preset": lambda: {"name": "A"},
        "kvlab.capacity.cost_model.CostModel.crossover_hit_rate": lambda: {"computed_tokens": 1000},
        "kvlab.capacity.cost_model.CostModel.forward_seconds": lambda: {"num_new_tokens": 100},
        "kvlab.capacity.cost_model.CostModel.implied_mfu": lambda: {"seconds": 0.1, "num_new_tokens": 100},
        "kvlab.capacity.cost_model.CostModel.memory_read_seconds": lambda: {"num_new_tokens": 100},
        "kvlab.capacity.cost_model.CostModel.prefill_flops": lambda: {"num_new_tokens": 100},
        "kvlab.capacity.cost_model.CostModel.prefill_seconds": lambda: {"num_new_tokens": 100},
        "kvlab.capacity.cost_model.CostModel.prefix_hit_speedup": lambda: {"prompt_tokens": 100, "reused_tokens": 50},
        "kvlab.capacity.cost_model.CostModel.recompute_seconds": lambda: {"computed_tokens": 100, "hit_tokens": 50},
        "kvlab.capacity.cost_model.CostModel.swap_or_recompute": lambda: {"computed_tokens": 100, "hit_tokens": 50},
        "kvlab.capacity.cost_model.CostModel.swap_seconds": lambda: {"computed_tokens": 100},
        "kvlab.capacity.cost_model.CostModel.ttft": lambda: {"prompt_tokens": 100, "reused_tokens": 50, "where": "gpu"},
        "kvlab.capacity.hardware.get_gpu": lambda: {"gpu": "H100-SXM-80GB"},
        "kvlab.capacity.hardware.get_host": lambda: {"host": "DGX-H100"},
        "kvlab.capacity.hardware.get_link": lambda: {"link": "PCIe 5.0 x16"},
        "kvlab.capacity.mla.MLADims": lambda: {"num_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                                               "qk_rope_head_dim": 64, "v_head_dim": 128},
        "kvlab.capacity.mla.absorb_crossover": lambda: {"model": get_model("deepseek-v3"), "context_len": 4096},
        "kvlab.capacity.mla.causal_pairs": lambda: {"query_len": 4, "context_len": 8},
        "kvlab.capacity.mla.mla_attention_cost": lambda: {"model": get_model("deepseek-v3"), "query_len": 4},
        "kvlab.capacity.mla.mla_dims": lambda: {"model": get_model("deepseek-v3")},
        "kvlab.capacity.models.parameter_parts": lambda: {"cfg": dict(get_model("deepseek-v3").config)},
        "kvlab.capacity.parallel.plan_parallel": lambda: {"model": "deepseek-v3", "layout": "tp", "num_gpus": 8,
                                                          "gpu_memory_gib": 141.0, "max_model_len": 8192},
        "kvlab.capacity.parallel.weights_bytes_per_gpu": lambda: {"model": get_model("deepseek-v3"), "layout": "tp",
                                                                  "num_gpus": 8},
        "kvlab.capacity.models.count_parameters": lambda: {"cfg": dict(get_model("llama-3-8b").config)},
        "kvlab.capacity.models.with_family_defaults": lambda: {"cfg": {"model_type": "gemma3_text"}},
        "kvlab.capacity.playbook.Workload": lambda: {"mean_prompt_tokens": 1000, "mean_output_tokens": 200},
        "kvlab.capacity.source_deployments.reproduce": lambda: {"key": "a"},
        "kvlab.capacity.startup_log.parse_startup_log": lambda: {"lines": _startup_lines()},
        "kvlab.capacity.startup_log.reconstruct": lambda: {"model": "llama-3-8b", "lines": _startup_lines()},
        "kvlab.capacity.tiers.KVTier": lambda: {"name": "HBM", "capacity_bytes": 1 << 30, "bytes_per_s": 1e9,
                                                "path": "gpu"},
        "kvlab.capacity.tiers.KVTier.holds": lambda: {"num_bytes": 1 << 20},
        "kvlab.capacity.tiers.KVTier.seconds_for": lambda: {"num_bytes": 1 << 20},
        "kvlab.core.block_pool.BlockPool.get_new_blocks": lambda: {"num_blocks": 2},
        "kvlab.core.block_pool.BlockPool.evict_blocks": lambda: {"block_ids": []},
        "kvlab.core.block_pool.BlockPool.get_cached_block": lambda: {"block_hash": none},
        "kvlab.core.cache_stats.interpret_hit_rate": lambda: {"hit_rate": 0.5, "workload_shares_prefixes": True},
        "kvlab.core.hashing.generate_block_hash_extra_keys": lambda: {"request": Request("r", list(range(8))),
                                                                      "start_token_idx": 0, "end_token_idx": 4},
        "kvlab.core.hashing.get_request_block_hasher": lambda: {"hash_block_size": 4, "caching_hash_fn": sha},
        "kvlab.core.hashing.hash_block_tokens": lambda: {"hash_function": sha, "parent_block_hash": none,
                                                         "curr_block_token_ids": [1, 2, 3, 4]},
        "kvlab.core.hashing.hash_fn_name": lambda: {"hash_fn": sha},
        "kvlab.core.hashing.hash_token_blocks": lambda: {"token_ids": list(range(8)), "block_size": 4},
        "kvlab.core.hashing.init_none_hash": lambda: {"hash_fn": sha},
        "kvlab.core.hashing.none_hash_from_seed": lambda: {"hash_fn": sha, "hash_seed": "0"},
        "kvlab.core.hashing.resolve_none_hash_seed": lambda: {"hash_fn": sha, "hash_seed": "0"},
        "kvlab.core.kv_cache_manager.KVCacheManager": lambda: {"num_blocks": 16, "block_size": 4},
        "kvlab.core.kv_cache_manager.KVCacheManager.allocate_slots": lambda: {"request": Request("r0", list(range(10))),
                                                                             "num_new_tokens": 10},
        "kvlab.core.kv_cache_manager.KVCacheManager.cache_blocks": lambda: {"request": Request("r0", list(range(10))),
                                                                           "num_tokens": 0},
        "kvlab.core.kv_cache_manager.find_longest_cache_hit": lambda: {
            "block_hashes": [none], "max_cache_hit_length": 4, "block_size": 4, "get_cached_block": lambda h: None},
        "kvlab.core.kv_cache_metrics.Histogram": lambda: {"name": "h", "documentation": "d", "buckets": [1.0, 2.0]},
        "kvlab.core.kv_cache_metrics.Histogram.observe": lambda: {"value": 1.5},
        "kvlab.core.kv_cache_metrics.Histogram.quantile": lambda: {"q": 0.5},
        "kvlab.core.kv_cache_metrics.Histogram.histogram_quantile": lambda: {"q": 0.5},
        "kvlab.core.kv_cache_metrics.KVCacheMetricsCollector.histogram": lambda: {"metric": "lifetime"},
        "kvlab.core.kv_cache_metrics.diagnose_pool": lambda: {"reuse_gaps": [1.0], "idle_before_evict": [2.0]},
        "kvlab.core.kv_cache_metrics.metric_name": lambda: {"metric": "lifetime", "unit": "steps"},
        "kvlab.core.kv_cache_metrics.nearest_rank": lambda: {"values": [1.0, 2.0], "q": 0.5},
        "kvlab.core.kv_cache_metrics.pool_too_small": lambda: {"reuse_gaps": [1.0], "idle_before_evict": [2.0]},
        "kvlab.core.kv_cache_metrics.prometheus_float": lambda: {"value": 1.5},
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue": lambda: {"blocks": [KVCacheBlock(i) for i in range(4)]},
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.popleft_n": lambda: {"n": 2},
        "kvlab.core.kv_cache_utils.FreeKVCacheBlockQueue.peek_n": lambda: {"n": 2},
        "kvlab.core.kv_cache_utils.KVCacheBlock": lambda: {"block_id": 3},
        "kvlab.core.kv_cache_utils.KVCacheBlock.set_block_hash": lambda: {"block_hash": none},
        "kvlab.core.kv_cache_utils.short_hash": lambda: {"block_hash": none},
        "kvlab.core.kv_offload.CPUOffloadingManager": lambda: {"num_blocks": 4},
        "kvlab.core.kv_offload.CPUOffloadingManager.lookup": lambda: {"block_hashes": [none]},
        "kvlab.core.kv_offload.CPUOffloadingManager.touch": lambda: {"block_hashes": []},
        "kvlab.core.kv_offload.CPUOffloadingManager.prepare_load": lambda: {"block_hashes": []},
        "kvlab.core.kv_offload.CPUOffloadingManager.complete_load": lambda: {"block_hashes": []},
        "kvlab.core.kv_offload.CPUOffloadingManager.prepare_store": lambda: {"block_hashes": [none]},
        "kvlab.core.kv_offload.CPUOffloadingManager.swap_out": lambda: {"request_id": "r0", "num_blocks": 2},
        "kvlab.core.kv_offload.OffloadingConnector": lambda: {"kv_cache_manager": KVCacheManager(16, 4),
                                                              "cpu_manager": CPUOffloadingManager(4)},
        "kvlab.core.request.MultiModalFeatureSpec": lambda: {"identifier": "img",
                                                             "mm_position": PlaceholderRange(0, 2)},
        "kvlab.core.request.PlaceholderRange": lambda: {"offset": 0, "length": 2},
        "kvlab.core.request.Request.append_output_token_ids": lambda: {"token_ids": [5]},
        "kvlab.core.request.Request.token_ids": lambda: {"start": 0, "end": 4},
        "kvlab.core.sched.output.SamplingParams.for_sample": lambda: {"index": 1},
        "kvlab.core.sched.output.child_request_id": lambda: {"parent_id": "p", "index": 1},
        "kvlab.core.sched.scheduler.Scheduler": lambda: {"kv_cache_manager": KVCacheManager(16, 4)},
        "kvlab.core.sched.loop.run_until_done": lambda: {"scheduler": _scheduler()},
        "kvlab.core.sched.loop.step": lambda: {"scheduler": _scheduler(), "executor": _executor()},
        "kvlab.core.sched.scheduler.Scheduler.finish_requests": lambda: {"request_ids": [], "finished_status":
                                                                        _aborted()},
        "kvlab.core.sequence.BlockContents": lambda: {"num_blocks": 4, "block_size": 4},
        "kvlab.core.sequence.BlockContents.clear": lambda: {"block_id": 1},
        "kvlab.core.sequence.BlockContents.copy": lambda: {"src_block_id": 1, "dst_block_id": 2},
        "kvlab.core.sequence.BlockContents.read": lambda: {"block_id": 1},
        "kvlab.core.sequence.BlockContents.write": lambda: {"block_id": 1, "slot": 0, "token_id": 7},
        "kvlab.core.sequence.Sequence.append": lambda: {"token_id": 7},
        "kvlab.core.sequence.Sequence.extend": lambda: {"token_ids": [7, 8]},
        "kvlab.core.sequence.compute_slot_mapping": lambda: {"block_table": [1, 2], "block_size": 4,
                                                            "positions": [0, 5]},
        "kvlab.sim.block_types.Op": lambda: {"kind": "append", "seq": "a", "tokens": (1,)},
        "kvlab.sim.block_types.Scenario": lambda: {"name": "s", "description": "d", "num_blocks": 4,
                                                       "block_size": 4, "ops": (Op("append", "a", (1,)),)},
        "kvlab.sim.block_scenarios.get_scenario": lambda: {"name": "random workload"},
        "kvlab.sim.block_scenarios.record": lambda: {"scenario": get_scenario("random workload")},
        "kvlab.sim.block_scenarios.step_at": lambda: {"scenario": get_scenario("random workload"), "index": 1},
        "kvlab.sim.collisions.count_distinct_hashes": lambda: {"hash_fn": sha, "parent_block_hash": none,
                                                               "blocks": [(1, 2), (3, 4)]},
        "kvlab.sim.collisions.find_block_collision": lambda: {"hash_fn": sweep_truncated(), "block_size": 2,
                                                              "parent_block_hash": none},
        "kvlab.sim.fragmentation.reservation": lambda: {"final_len": 100, "policy": "max",
                                                        "max_model_len": 2048},
        "kvlab.sim.fragmentation.simulate": lambda: {"requests": [[10, 5], [20, 8]], "pool_tokens": 4096,
                                                     "max_model_len": 2048, "policy": "paged"},
        "kvlab.sim.fragmentation_fast.FirstFit": lambda: {"size": 64},
        "kvlab.sim.fragmentation_fast.FirstFit.allocate": lambda: {"length": 8},
        "kvlab.sim.fragmentation_fast.FirstFit.release": lambda: {"start": 0, "length": 0},
        "kvlab.sim.lifecycle.Event": lambda: {"kind": "arrive", "request": "a"},
        "kvlab.sim.lifecycle.lifecycle_step_at": lambda: {"index": 1},
        "kvlab.sim.prefix_sim.SimRequest": lambda: {"request_id": "a", "prompt_token_ids": (1, 2, 3),
                                                    "output_token_ids": (4,)},
        "kvlab.sim.prefix_sim.min_num_blocks": lambda: {"requests": shared_prompt_workload(4), "block_size": 16},
        "kvlab.sim.prefix_sim.simulate": lambda: {"requests": shared_prompt_workload(4), "num_blocks": 64},
        "kvlab.sim.prefix_sim.sweep_pool_sizes": lambda: {"requests": shared_prompt_workload(4),
                                                          "pool_sizes": [64]},
        "kvlab.sim.sharing.parallel_sampling_saving": lambda: {"requests": [[40, 12]], "n": 4},
        "kvlab.sim.workloads.summarize": lambda: {"requests": [[10, 5], [20, 8]]},
        "kvlab.sim.workloads.validate_requests": lambda: {"requests": [[10, 5], [20, 8]]},
        "kvlab.sim.workloads.workload_stats": lambda: {"name": "alpaca"},
        "kvlab.sim.serving_sim.simulate_chat": lambda: {"num_gpu_blocks": 64},
        "kvlab.sim.prefix_sim.admit": lambda: {"manager": KVCacheManager(16, 4), "request": Request("r", [1, 2, 3])},
        "kvlab.sim.hash_cost.measure_hash_cost": lambda: {"number": 5, "repeat": 1, "block_sizes": (16,),
                                                          "hash_fn_names": ("sha256",)},
    }


def _startup_lines() -> list[str]:
    from kvlab.capacity.budget import plan_preset

    return plan_preset("A").startup_log()


def sweep_truncated() -> Any:
    from kvlab.sim.collisions import truncated_hash

    return truncated_hash("sha256", 8)


def _scheduler() -> Any:
    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.core.sched.output import GenerationRequest
    from kvlab.core.sched.scheduler import Scheduler

    scheduler = Scheduler(KVCacheManager(16, 4))
    scheduler.add_request(GenerationRequest("g", [1, 2, 3]))
    return scheduler


def _executor() -> Any:
    from kvlab.core.sched.loop import NoComputeExecutor

    return NoComputeExecutor()


def _aborted() -> Any:
    from kvlab.core.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


# Parameters whose meaning allows what the generic probes call wrong.
RULES: dict[str, dict[str, Any]] = {
    "kvlab.core.kv_cache_utils.KVCacheBlock:block_id": {"signed": True},  # the free queue's sentinels are -1
    "kvlab.core.kv_cache_metrics.Histogram:documentation": {"free_text": True},
    "kvlab.sim.block_types.Op:seq": {"free_text": True},  # a sequence's name
    "kvlab.sim.lifecycle.Event:request": {"free_text": True},  # a request's name
    "kvlab.sim.prefix_sim.SimRequest:after": {"free_text": True},  # another request's id
    "kvlab.capacity.models.resolve_model:parameter": {"free_text": True},  # the caller's parameter name
    "kvlab.capacity.config_fields.check_config_fields:parameter": {"free_text": True},  # likewise
    "kvlab.units.format_bytes:num_bytes": {"signed": True},  # a difference of sizes prints too
    "kvlab.units.cdiv:a": {"signed": True},  # vLLM's cdiv takes any integer numerator
}
# A kvlab error may name the parameter by the name the caller knows it under.
ALSO_NAMED: dict[str, tuple[str, ...]] = {}


@pytest.fixture(scope="module")
def result() -> sweep.SweepResult:
    return sweep.run_sweep(_overrides(), RULES, SKIP, ALSO_NAMED)


def _report(probes: list[sweep.Probe]) -> str:
    return "\n".join(f"{p.target}({p.parameter}={p.value}): {p.outcome} {p.detail}" for p in probes[:60])


def test_every_public_callable_has_a_working_call(result: sweep.SweepResult) -> None:
    """A callable without a working baseline is not swept at all: each needs a sample or an override."""
    assert not result.baselines_failed, "\n".join(f"{k}: {v}" for k, v in sorted(result.baselines_failed.items()))


def test_the_sweep_is_large(result: sweep.SweepResult) -> None:
    counts = collections.Counter(p.outcome for p in result.probes)
    print(f"input sweep: {len(result.probes)} calls, {dict(counts)}")
    assert len(result.probes) >= 1000


def test_no_generic_error_leaks(result: sweep.SweepResult) -> None:
    assert not result.of("generic"), _report(result.of("generic"))


def test_no_wrong_input_is_accepted_silently(result: sweep.SweepResult) -> None:
    assert not result.of("silent"), _report(result.of("silent"))


def test_no_call_hangs(result: sweep.SweepResult) -> None:
    assert not result.of("hang"), _report(result.of("hang"))


def test_every_refusal_names_the_parameter(result: sweep.SweepResult) -> None:
    assert not result.of("unnamed"), _report(result.of("unnamed"))


# The issue's own examples of wrong input accepted silently: values of the right type that break a rule.
def _spec(**changes: Any) -> Any:
    from kvlab.capacity.models import ModelSpec

    fields = {"name": "x", "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 4, "head_dim": 64,
              "attention": "mha", **changes}
    return ModelSpec(**fields)


def _transfer(transfers: list[tuple[int, int]]) -> None:
    import torch

    from kvlab.engine.kv_offload import transfer_blocks

    k, v = torch.zeros(4, 2, 1, 2), torch.zeros(4, 2, 1, 2)  # [num_blocks, block_size, num_kv_heads, head_size]
    transfer_blocks([(k, v)], [(k.clone(), v.clone())], transfers)


@pytest.mark.parametrize(("call", "named"), [
    (lambda: _spec(num_kv_heads=8), "num_kv_heads=8"),                          # 8 KV heads for 4 query heads
    (lambda: _spec(num_kv_heads=2), "attention='mha'"),                          # "mha" with grouped heads
    (lambda: _spec(num_kv_heads=3), "num_kv_heads=3"),                           # a group size that does not divide
    (lambda: _spec(attention="mqa", num_kv_heads=2), "attention='mqa'"),
    (lambda: _spec(layer_types=("bogus", "full_attention")), "layer_types"),
    (lambda: _transfer([(-1, 0)]), "transfers[0]"),                              # source -1 would copy the last block
    (lambda: _transfer([(0, 4)]), "transfers[0]"),
], ids=["kv>q", "mha-grouped", "kv-not-divisor", "mqa-two", "layer-type", "transfer-negative", "transfer-past-end"])
def test_values_that_break_a_rule_are_refused_by_name(call: Any, named: str) -> None:
    from kvlab.errors import KvlabValueError

    with pytest.raises(KvlabValueError, match=re.escape(named)):
        call()


def test_a_negative_vocab_size_in_config_json_is_refused(tmp_path: Any) -> None:
    import json

    from kvlab.data import DATA_DIR
    from kvlab.engine.config import DecoderConfig
    from kvlab.errors import CheckpointError

    config = json.loads((DATA_DIR / "tiny-pydoc-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": -128256}))
    with pytest.raises(CheckpointError, match="vocab_size"):
        DecoderConfig.from_pretrained(tmp_path)


# Beyond the fixed probes: hypothesis draws a callable, one of its parameters and a value of any shape.
# A random value may be valid, so only what is never right is checked: no generic error, no hang, and a
# refusal names the parameter.
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(min_value=-3, max_value=40), max_size=5), st.tuples(st.integers(), st.text(max_size=3)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def prepared() -> list[sweep.Prepared]:
    return [p for p in sweep.prepare(_overrides(), SKIP) if sweep.probed_parameters(p)]


@settings(max_examples=300, deadline=None, derandomize=True,  # the same draws every run: CI never flakes
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_values_never_leak_a_generic_error(prepared: list[sweep.Prepared], data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(prepared), label="callable")
    parameter = data.draw(st.sampled_from(sweep.probed_parameters(target)), label="parameter").name
    value = data.draw(ANY_VALUE, label="value")
    outcome, detail = sweep.classify(target.target, parameter, target.probe(parameter, value), must_refuse=False,
                                     also_named=ALSO_NAMED.get(f"{target.target.name}:{parameter}", ()))
    assert outcome in ("ok", "accepted"), f"{target.target.name}({parameter}={value!r}): {outcome} {detail}"


# config.json contents are a door too (issue 27 item 4): every field of every real config in data/models/, given
# the wrong type, None, NaN, a negative or a huge value, through every function that reads a config dict.
@pytest.fixture(scope="module")
def config_result() -> sweep.SweepResult:
    import json

    from kvlab.capacity.models import MODELS_DIR

    configs = {p.stem: json.loads(p.read_text()) for p in sorted(MODELS_DIR.glob("*.json"))}
    return sweep.run_config_sweep(configs)


def test_the_config_sweep_reaches_every_reader(config_result: sweep.SweepResult) -> None:
    readers = {p.target.split(" @ ")[0] for p in config_result.probes}
    assert readers == set(sweep.config_readers()), config_result.skipped
    assert len(config_result.probes) >= 5000


@pytest.mark.parametrize("outcome", ["generic", "silent", "hang", "unnamed"])
def test_no_config_field_is_misread(config_result: sweep.SweepResult, outcome: str) -> None:
    assert not config_result.of(outcome), _report(config_result.of(outcome))


def test_every_field_kvlab_reads_is_in_the_door() -> None:
    """A reader's ``cfg.get("x")`` / ``params["x"]`` on a field the door does not know would read it unchecked."""
    from pathlib import Path

    import kvlab
    from kvlab.capacity.config_fields import CONFIG_FIELDS, NESTED_FIELDS

    known = set(CONFIG_FIELDS).union(*(set(fields) for fields in NESTED_FIELDS.values()))
    root = Path(kvlab.__file__).parent
    readers = ["capacity/models.py", "capacity/mla.py", "capacity/cost_model.py", "engine/config.py",
               "engine/deepseek_config.py", "engine/deepseek_rope.py"]
    pattern = re.compile(r"\b(?:cfg|config|params|quant|raw)(?:\.get\(|\[)\"(\w+)\"")
    read = {key for path in readers for key in pattern.findall((root / path).read_text())}
    assert read and read <= known, sorted(read - known)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vocab_size", "32000", "config.json field 'vocab_size' must be a positive integer"),
    ("vocab_size", [32000], "config.json field 'vocab_size'"),
    ("model_type", None, "config.json field 'model_type' must be a string, got None"),
    ("model_type", 5, "config.json field 'model_type' must be a string, got 5"),
    ("quantization_config", "fp8", "config.json field 'quantization_config' must be an object"),
    ("vocab_size", -1, "config.json field 'vocab_size'"),
    ("intermediate_size", -1, "config.json field 'intermediate_size'"),
    ("torch_dtype", 5, "config.json field 'torch_dtype' must be one of"),
    ("torch_dtype", float("nan"), "config.json field 'torch_dtype'"),
])
def test_the_issues_config_examples_are_refused_by_field(field: str, value: Any, message: str) -> None:
    import json

    from kvlab.capacity.models import MODELS_DIR, ModelSpec, count_parameters
    from kvlab.errors import ConfigFieldError

    config = {**json.loads((MODELS_DIR / "llama-3-8b.json").read_text()), field: value}
    for read in (ModelSpec.from_hf_config, count_parameters):
        with pytest.raises(ConfigFieldError, match=re.escape(message)):
            read(config)


def test_a_model_of_a_quadrillion_layers_is_refused_not_built() -> None:
    from kvlab.errors import KvlabValueError

    with pytest.raises(KvlabValueError, match="num_layers"):
        _spec(num_layers=10**15)
