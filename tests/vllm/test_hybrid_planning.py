"""kvlab's KV cache groups and hybrid pool against vLLM 0.33.0's own planning functions, on the same layer specs.

vLLM's ``get_kv_cache_configs`` needs a ``VllmConfig`` with a ``ModelConfig``, which inspects the
model's architecture class (its imports need CUDA extensions this machine lacks), so the
comparison calls the functions it is made of: ``_get_kv_cache_groups_uniform_page_size`` (the
grouping), ``_get_kv_cache_bytes_per_block`` (a block's bytes), the specs' own
``max_admission_blocks_per_request`` and page sizes (what one request holds), and a real CPU
``VllmConfig``'s ``max_in_flight_tokens`` (what async scheduling keeps in flight).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.33.0 is not installed here: run make test-vllm")

import torch  # noqa: E402
from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.core import kv_cache_planning as planning  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvlab.capacity.hybrid import get_kv_cache_groups, layer_specs, plan_hybrid_kv_cache  # noqa: E402
from kvlab.capacity.models import ModelSpec, get_model  # noqa: E402
from kvlab.units import cdiv  # noqa: E402


def vllm_specs(model: ModelSpec, block_size: int) -> dict:
    """The specs vLLM's attention layers report for ``model`` in bf16 (``get_kv_cache_spec``)."""
    shape = dict(block_size=block_size, num_kv_heads=model.num_kv_heads, head_size=model.head_dim,
                 dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": (SlidingWindowSpec(**shape, sliding_window=model.sliding_window)
                                                 if kind == "sliding_attention" else FullAttentionSpec(**shape))
            for i, kind in enumerate(model.layer_types)}


def synthetic(pattern: str, window: int = 512) -> ModelSpec:
    """A model whose layer ``i`` slides where ``pattern[i]`` is "s" (Gemma 3's 5:1, gpt-oss with an EAGLE layer)."""
    return ModelSpec(name=pattern, num_layers=len(pattern), num_attention_heads=8, num_kv_heads=4, head_dim=128,
                     attention="gqa", sliding_window=window,
                     layer_types=tuple("sliding_attention" if c == "s" else "full_attention" for c in pattern))


MODELS = [get_model("gpt-oss-20b"), get_model("gemma-2-9b"), synthetic("sssssf" * 4), synthetic("s" * 12 + "f" * 13),
          synthetic("sf" * 3 + "ff")]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("block_size", [16, 64])
def test_the_groups_and_a_blocks_bytes_are_vllms(model, block_size):
    ours = get_kv_cache_groups(layer_specs(model, block_size))
    theirs = planning._get_kv_cache_groups_uniform_page_size(vllm_specs(model, block_size))
    assert [g.layer_names for g in ours] == [tuple(g.layer_names) for g in theirs]
    assert [g.kv_cache_spec.kind for g in ours] == [
        "sliding_attention" if isinstance(g.kv_cache_spec, SlidingWindowSpec) else "full_attention" for g in theirs]
    assert [g.kv_cache_spec.page_size_bytes for g in ours] == [g.kv_cache_spec.page_size_bytes for g in theirs]
    plan = plan_hybrid_kv_cache(model, max_model_len=8192, block_size=block_size, gpu_memory_gib=80,
                                kv_cache_memory_gib=10)
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLHNC):
        assert plan.bytes_per_block == planning._get_kv_cache_bytes_per_block(theirs, layout)


@pytest.mark.parametrize("model", MODELS[:2], ids=lambda m: m.name)
@pytest.mark.parametrize("max_model_len", [4096, 8192, 131072])
def test_a_requests_blocks_and_the_concurrency_are_vllms(model, max_model_len):
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), scheduler_config=SchedulerConfig(
        max_num_batched_tokens=8192, max_model_len=max_model_len, is_encoder_decoder=False))
    plan = plan_hybrid_kv_cache(model, max_model_len=max_model_len, gpu_memory_gib=80, kv_cache_memory_gib=40)
    assert plan.max_in_flight_tokens == config.max_in_flight_tokens  # vLLM's own count: async scheduling, two batches
    theirs = planning._get_kv_cache_groups_uniform_page_size(vllm_specs(model, 16))
    # get_max_concurrency_for_kv_cache_config: cdiv(max_memory_usage_bytes, page) per group, summed
    per_request = []
    for group in theirs:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            usage = spec.max_admission_blocks_per_request(config.max_in_flight_tokens, max_model_len) * \
                spec.page_size_bytes
        else:
            usage = cdiv(max_model_len, spec.block_size) * spec.page_size_bytes
        per_request.append(cdiv(usage, spec.page_size_bytes))
    assert list(plan.blocks_per_request) == per_request
    num_blocks = 40 * 2**30 // planning._get_kv_cache_bytes_per_block(theirs, KVCacheLayout.LBNHC)
    assert plan.num_blocks == num_blocks and plan.max_concurrency == num_blocks / sum(per_request)
    assert plan.kv_cache_size_tokens == int(num_blocks / sum(per_request) * max_model_len)


@pytest.mark.parametrize("model", [*MODELS[:2], get_model("llama-3-8b"), get_model("deepseek-v3")],
                         ids=lambda m: m.name)
def test_each_layers_spec_is_vllms_field_for_field(model):
    """kvlab's one spec hierarchy has vLLM's classes, fields and ``page_size_bytes`` (kvlab names the dtype)."""
    import vllm.v1.kv_cache_interface as interface

    mla = model.attention == "mla"
    for name, ours in layer_specs(model, 16).items():
        theirs = interface.MLAAttentionSpec(  # as MLAAttention.get_kv_cache_spec makes it
            block_size=16, num_kv_heads=1, head_size=model.head_dim, max_tp_shards=1, dtype=torch.bfloat16,
        ) if mla else vllm_specs(model, 16)[name]
        assert type(ours).__name__ == type(theirs).__name__
        fields = ("block_size", "num_kv_heads", "head_size", "head_size_v", "page_size_bytes", "max_tp_shards",
                  *(("sliding_window",) if hasattr(theirs, "sliding_window") and not mla else ()))
        assert [getattr(ours, f, None) for f in fields] == [getattr(theirs, f) for f in fields]
        assert ours.dtype == "bf16" and theirs.dtype == torch.bfloat16


def test_the_layout_tests_spec_classes_are_vllms():
    """The names ``tests/test_architecture.py`` allows once each are classes of 0.33.0's kv_cache_interface.py."""
    import ast
    import inspect
    from pathlib import Path

    import vllm.v1.kv_cache_interface as interface

    source = (Path(__file__).parents[1] / "test_architecture.py").read_text()
    names = next(ast.literal_eval(node.value) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                 and [getattr(t, "id", None) for t in node.targets] == ["VLLM_SPEC_CLASSES"])
    assert names and [name for name in names if not inspect.isclass(getattr(interface, name, None))] == []
