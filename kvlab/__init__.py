"""kvlab: the code behind a workbook on how LLM serving engines manage the KV cache.

kvlab follows vLLM 0.33.0 (``VLLM_VERSION``): its names and behaviour, so that a learner who
finishes the workbook can open ``vllm/v1/core/`` next and find the same files. The package is
in layers; each may import only the layers below it (``tests/test_architecture.py`` enforces
the rules written in ``pyproject.toml``, ``[tool.kvlab.layers]``):

* top level: ``errors``, ``units`` (binary units, ``cdiv``), ``data`` (where ``data/`` is),
  ``machine`` (what a measurement ran on), ``_validate`` (argument checks);
* ``capacity/``: arithmetic on model configs and GPUs, no torch;
* ``core/``: the allocator and the scheduler, bookkeeping only, mirroring ``vllm/v1/core/``;
* ``sim/``: seeded workloads and the simulations the notebooks run on ``core`` and ``capacity``;
* ``kernels/`` (``kvlab.kernels``): the Triton kernels, which import nothing of kvlab but ``errors``
  and ``units`` (``cdiv``);
* ``engine/``: a real model serving through ``core`` and ``kernels``;
* ``viz/`` (figures and panels) and ``exercises/`` (the grader) on top.

The map: each notebook, the modules it uses, and the vLLM 0.33.0 file each mirrors.

==  ==================================  ==========================================================
#   kvlab module                        mirrors (vLLM 0.33.0) or teaches
==  ==================================  ==========================================================
01  capacity.models                     ``config.json`` fields (``vllm/config/model.py`` reads them)
01  capacity.sizing                     ``AttentionSpec.page_size_bytes`` (``vllm/v1/kv_cache_interface.py``)
02  capacity.budget                     ``vllm/v1/core/kv_cache_utils.py`` (``get_kv_cache_configs``), the worker's
                                        memory profiling (``vllm/v1/worker/gpu_worker.py``)
02  sim.workloads, sim.fragmentation    contiguous reservation against paging (the PagedAttention paper), step by
    (and sim.fragmentation_fast)        step and event by event
02  sim.sharing                         parallel sampling's shared prompt blocks, measured (the paper's Fig. 15)
03  core.kv_cache_utils                 ``KVCacheBlock``, ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``)
03  core.block_pool                     ``BlockPool``, ``BlockHashToBlockMap`` (``vllm/v1/core/block_pool.py``)
03  core.sequence, sim.block_scenarios  block tables, slot mapping, fork and copy-on-write (the paper's, and
    (+ sim.block_narration)             ``vllm/v1/worker/block_table.py``); the stepper's sentences
04  core.hashing                        ``hash_block_tokens``, ``NONE_HASH`` (``kv_cache_utils.py``,
                                        ``vllm/utils/hashing.py``)
04  core.request                        ``Request`` (``vllm/v1/request.py``)
04  core.kv_cache_manager               ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``,
    (+ manager_checks, manager_fork)    ``single_type_kv_cache_manager.py``), its input checks, kvlab's fork
04  core.cache_stats                    ``PrefixCacheStats``, ``CachingMetrics`` (``vllm/v1/metrics/stats.py``),
                                        kvlab's eviction counter
04  sim.prefix_sim, sim.hash_cost,      hit rates against pool size, hashing cost, collisions on purpose
    sim.collisions
04  sim.lifecycle                       one request's allocate, hit, free and evict on the real manager
05  kernels (attention, cache_write)    ``triton_unified_attention.py``, ``reshape_and_cache_flash``
                                        (``vllm/v1/attention/ops/``); the sliding window as ``triton_attn.py`` passes it
05  kernels.verify, batches, mutants    kvlab's own: ``check_kernel``, a bench for a learner's kernel, and broken copies
05  kernels.program_view                kvlab's own: what each program of a launch loaded and stored (the puzzles' view)
05  kernels.layouts, legacy_layout    vLLM's older 5-D K layout and the legacy CUDA kernel's warps and thread groups
                                        (``csrc/attention/attention_kernels.cuh``, before the Triton backends)
06  engine.hard_paths                   kvlab's own: the comparison with transformers where kernel bugs live
06  core.sched.output                   ``SchedulerOutput`` (``vllm/v1/core/sched/output.py``), ``SamplingParams``
06  core.sched.config                   ``SchedulerConfig`` (``vllm/config/scheduler.py``)
06  core.sched.scheduler                ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``)
06  core.sched.loop                     ``EngineCore.step`` (``vllm/v1/engine/core.py``), a no-compute executor
06  engine.engine_config                ``EngineConfig`` (``VllmConfig`` and its parts, ``vllm/config/``)
06  engine                              ``LLMEngine``, ``GPUModelRunner``, the sampler, the KV pool's start-up
                                        (``vllm/v1/engine/``, ``vllm/v1/worker/``)
07  capacity.hardware, cost_model,      GPUs, links and servers as datasheets give them; a modelled cost of prefill
    playbook, source_deployments,       (compute and the weights-read roofline) and copies; the capacity-planning
    startup_log, tiers                  playbook, the source articles' deployments, a start-up log read backwards,
                                        and the GPU / CPU / SSD tiers of one server
07  core.kv_cache_metrics               ``KVCacheMetricsCollector`` (``vllm/v1/core/kv_cache_metrics.py``)
07  core.kv_offload, engine.kv_offload  ``OffloadingConnector``, ``CPUOffloadingManager`` (``vllm/v1/kv_offload/``)
07  sim.serving_sim                     multi-turn chat on the no-compute scheduler
08  kv_cache_interface                  the one spec hierarchy: ``FullAttentionSpec``, ``SlidingWindowSpec``,
                                        ``MLAAttentionSpec`` (``page_size_bytes`` from the layer's shape),
                                        ``KVCacheGroupSpec`` (``vllm/v1/kv_cache_interface.py``)
08  capacity.hybrid                     KV cache groups and the hybrid budget (``vllm/v1/core/kv_cache_planning.py``,
                                        ``get_max_concurrency_for_kv_cache_config`` in ``kv_cache_utils.py``)
08  core.kv_cache_coordinator,          ``HybridKVCacheCoordinator`` and its agreement, ``FullAttentionManager``,
    core.single_type_kv_cache_manager   ``SlidingWindowManager`` (``vllm/v1/core/kv_cache_coordinator.py``,
                                        ``single_type_kv_cache_manager.py``)
08  sim.hybrid_hits, engine.hybrid      kvlab's own: one request's hit kind by kind; the pool measured with groups
                                        and as full attention (``--disable-hybrid-kv-cache-manager``)
09  capacity.mla                        naive (``forward_mha``) against absorbed (``forward_mqa``) MLA, counted
                                        (``vllm/model_executor/layers/attention/mla_attention.py``)
09  kernels (mla_cache_write,           ``concat_and_cache_mla`` (``vllm/_custom_ops.py``); the Triton MLA decode
    mla_decode, mla_absorb)             (``vllm/v1/attention/backends/mla/triton_mla.py``,
                                        ``vllm/v1/attention/ops/triton_decode_attention.py``)
09  engine.mla, engine.deepseek         ``MLAAttention``, ``DeepseekV2ForCausalLM`` (``vllm/model_executor/models/
                                        deepseek_v2.py``) over one latent cache per layer (``MLAAttentionSpec``)
09  kernels.mla_grid                    the MLA decode's grid and split ranges (``triton_decode_attention.py``'s launch)
09  engine.kv_cache_interface,          a layer's tensors from its ``MLAAttentionSpec`` or ``FullAttentionSpec``
    engine.registry                     (``GPUModelRunner.initialize_kv_cache``); the architectures the engine
                                        serves, by ``model_type``
                                        (``vllm/model_executor/models/registry.py``)
09  capacity.parallel                   TP against data-parallel attention per GPU (``max_tp_shards``;
                                        ``data_parallel_size``, ``enable_expert_parallel``: ``vllm/config/parallel.py``)
10  core.kv_cache_events,               the events ``BlockPool`` queues and their wire form (``BlockStored``,
    distributed.kv_events               ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``, the ZMQ publisher,
                                        ``KVEventsConfig``: ``vllm/distributed/kv_events.py``, ``config/kv_events.py``)
10  fleet.metrics                       a replica's ``/metrics`` in vLLM's names (``vllm/v1/metrics/loggers.py``)
10  fleet.routers, fleet.simulation,    kvlab's own: routers after production-stack, SGLang, llm-d and Dynamo; the
    fleet.replica, fleet.serving        fleet over core managers, replicas as processes on ZMQ and HTTP (no-compute,
                                        or ``LLMEngine``s publishing their events), driven in real time
10  engine.kv_events_config             ``KVEventsConfig`` (``vllm/config/kv_events.py``), the engine's events config
11  distributed.parallel_state          ``GroupCoordinator`` (a ``device_group`` and a gloo ``cpu_group``),
                                        ``init_distributed_environment``, ``initialize_model_parallel``
                                        (``vllm/distributed/parallel_state.py``)
11  engine.linear,                      ``ColumnParallelLinear``, ``RowParallelLinear``, ``QKVParallelLinear``'s split
    engine.vocab_parallel_embedding     (``vllm/model_executor/layers/linear.py``), ``VocabParallelEmbedding``,
                                        ``ParallelLMHead`` (``vocab_parallel_embedding.py``)
11  engine.worker, engine.worker_proc,  ``Worker`` (``vllm/v1/worker/gpu_worker.py``), ``MultiprocExecutor`` and
    engine.multiproc_executor,          ``WorkerProc`` (``vllm/v1/executor/multiproc_executor.py``),
    engine.uniproc_executor,            ``ExecutorWithExternalLauncher`` (``uniproc_executor.py``); torchrun's
    engine.launch                       entry point
11  engine.tensor_parallel,             kvlab's own: TP measured against one rank and the formula; a step's
    capacity.tp_cost                    collectives counted and modelled on NVLink and PCIe
11  distributed.kv_transfer             ``KVConnectorBase_V1`` and its roles, ``ExampleConnector``, the factory
                                        (``vllm/distributed/kv_transfer/kv_connector/``); ``P2pGlooConnector`` is
                                        kvlab's own, on the NIXL connector's handshake; ``TransferTopology``
                                        (``kv_connector/utils.py``, ``nixl/tp_mapping.py``): heads re-sliced
11  engine.kv_transfer_config,          ``KVTransferConfig`` (``vllm/config/kv_transfer.py``); the worker half around
    engine.kv_connector_model_runner    the forward (``vllm/v1/worker/kv_connector_model_runner_mixin.py``)
11  fleet.disagg, sim.disaggregation,   kvlab's own: a 1P1D proxy; colocated against disaggregated serving on
    capacity.disaggregation             per-engine clocks, modelled and measured; bytes moved, move or recompute
==  ==================================  ==========================================================

The names below are importable from ``kvlab`` itself; they load on first use, so importing
``kvlab.errors`` (as the kernels do) pulls in nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

VLLM_VERSION = "0.33.0"
__version__ = "0.1.0"

#: top-level name -> the module that defines it
_LAZY = {
    "KvlabError": "kvlab.errors",
    "KvlabValueError": "kvlab.errors",
    "ModelSpec": "kvlab.capacity.models",
    "get_model": "kvlab.capacity.models",
    "list_models": "kvlab.capacity.models",
    "kv_bytes": "kvlab.capacity.sizing",
    "kv_bytes_per_token": "kvlab.capacity.sizing",
    "GiB": "kvlab.units",
    "KiB": "kvlab.units",
    "MiB": "kvlab.units",
    "cdiv": "kvlab.units",
    "format_bytes": "kvlab.units",
}

__all__ = ["VLLM_VERSION", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    """Load a top-level name from its module the first time it is asked for (PEP 562)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
