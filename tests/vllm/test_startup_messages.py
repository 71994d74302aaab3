"""What kvlab prints at start-up against what vLLM 0.33.0's own functions print for the same numbers.

The start-up line (``update_kv_cache_capacity``, its token count from ``get_kv_cache_capacity``), the two
memory errors (``_check_enough_kv_cache_memory``), the GiB rounding (``format_gib``) and the default
``max_num_batched_tokens`` (``EngineArgs.get_batch_defaults``) are called with the plan's numbers; what
those functions read from a ``VllmConfig`` is given as a namespace, so no model or GPU is needed.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.33.0 is not installed here: run make test-vllm")

from vllm.engine import arg_utils  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.utils.mem_utils import format_gib as vllm_format_gib  # noqa: E402
from vllm.v1.core import kv_cache_planning, kv_cache_utils  # noqa: E402

from kvlab.capacity.budget import KVCachePlan, format_gib, plan_kv_cache, plan_preset  # noqa: E402
from kvlab.capacity.hardware import get_gpu, list_gpus  # noqa: E402
from kvlab.capacity.hybrid import default_max_num_batched_tokens  # noqa: E402
from kvlab.units import GiB  # noqa: E402

PLANS = {"preset A": lambda: plan_preset("A"), "preset B": lambda: plan_preset("B"),
         "off the block grid": lambda: plan_kv_cache("llama-3-8b", gpu_memory_gib=80, max_model_len=8190),
         "fp8, 48 GiB": lambda: plan_kv_cache("llama-3-8b", gpu_memory_gib=80, kv_cache_memory_gib=48,
                                               kv_dtype="fp8", max_model_len=8192)}


def vllm_config(plan: KVCachePlan) -> types.SimpleNamespace:
    """What ``update_kv_cache_capacity`` reads of a ``VllmConfig``, for ``plan`` on a CUDA GPU."""
    return types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=plan.max_model_len),
                                 cache_config=types.SimpleNamespace(), device_config=types.SimpleNamespace(
                                     device_type="cuda"), attention_config=types.SimpleNamespace(hisparse_config=None))


@pytest.mark.parametrize("name", PLANS)
def test_the_startup_line_is_the_one_update_kv_cache_capacity_logs(name, monkeypatch):
    plan = PLANS[name]()
    logged = []
    monkeypatch.setattr(kv_cache_utils, "get_max_concurrency_for_kv_cache_config",
                        lambda config, kv_cache_config: plan.num_blocks / plan.blocks_per_request)
    monkeypatch.setattr(kv_cache_utils.logger, "info_once", lambda fmt, *args, **kw: logged.append(fmt % args))
    config = vllm_config(plan)
    kv_cache_utils.update_kv_cache_capacity(config, None)
    assert plan.startup_log() == logged
    assert config.cache_config.kv_cache_size_tokens == plan.kv_cache_size_tokens


@pytest.mark.parametrize("plan", [plan_preset("C"), plan_kv_cache("llama-3-70b", gpu_memory_gib=80, max_model_len=8192),
                                  plan_kv_cache("llama-3-8b", gpu_memory_gib=24, non_kv_peak_gib=6, max_model_len=65536,
                                                block_size=16)],
                         ids=["too small, with an estimate", "no memory at all", "too small, L4-like"])
def test_the_memory_errors_are_the_ones_check_enough_kv_cache_memory_raises(plan):
    assert not plan.fits
    with pytest.raises(ValueError) as raised:
        kv_cache_planning._check_enough_kv_cache_memory(
            plan.available_bytes, lambda: plan.blocks_per_request * plan.bytes_per_block, plan.max_model_len,
            lambda available: min(available // plan.bytes_per_block * plan.block_size, plan.max_model_len))
    assert plan.startup_log() == [f"ValueError: {raised.value}"]


@pytest.mark.parametrize("num_bytes", [0, 1, GiB, 15 * GiB + 12345678, 130 * GiB, int(14.955 * GiB), 2**40 - 1])
def test_gib_are_rounded_as_vllm_rounds_them(num_bytes):
    assert format_gib(num_bytes) == vllm_format_gib(num_bytes)


@pytest.mark.parametrize("gpu", list_gpus())
def test_the_default_batched_tokens_are_get_batch_defaults(gpu, monkeypatch):
    spec = get_gpu(gpu)
    platform = arg_utils.current_platform
    monkeypatch.setattr(platform, "get_device_total_memory", lambda *a, **k: int(spec.memory_gib * GiB), raising=False)
    monkeypatch.setattr(platform, "get_device_name", lambda *a, **k: f"NVIDIA {spec.name}", raising=False)
    monkeypatch.setattr(platform, "is_device_capability", lambda *a, **k: False, raising=False)
    monkeypatch.setattr(platform, "is_tpu", lambda *a, **k: False, raising=False)
    monkeypatch.setattr(platform, "is_cpu", lambda *a, **k: False, raising=False)
    tokens, _ = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    assert default_max_num_batched_tokens(gpu) == tokens[UsageContext.LLM_CLASS]
    assert default_max_num_batched_tokens(gpu, api_server=True) == tokens[UsageContext.OPENAI_API_SERVER]


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma3", "gemma2", "glm4", "llama", "qwen3"])
def test_the_float16_refusal_is_vllms_table_and_message(model_type):
    """``_check_valid_dtype``: the families that may not compute in float16, refused with vLLM's own words."""
    import torch
    from vllm.config import model as vllm_model

    from kvlab.engine.dtype import FLOAT16_NOT_SUPPORTED_MODELS, resolve_dtype
    from kvlab.errors import KvlabValueError

    assert FLOAT16_NOT_SUPPORTED_MODELS == vllm_model._FLOAT16_NOT_SUPPORTED_MODELS
    cpu = torch.device("cpu")
    if model_type not in FLOAT16_NOT_SUPPORTED_MODELS:
        vllm_model._check_valid_dtype(model_type, torch.float16)
        assert resolve_dtype("float16", torch.bfloat16, cpu, False, model_type)[0] == torch.float16
        return
    with pytest.raises(ValueError) as theirs:
        vllm_model._check_valid_dtype(model_type, torch.float16)
    with pytest.raises(KvlabValueError) as ours:
        resolve_dtype("float16", torch.bfloat16, cpu, False, model_type)
    assert str(theirs.value) in str(ours.value)
    assert resolve_dtype("auto", torch.float16, cpu, False, model_type)[0] == torch.bfloat16  # fp16 skipped
