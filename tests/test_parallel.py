"""Several GPUs: MLA's latent is replicated under tensor parallelism, stored once under data-parallel attention."""

import pytest

from kvlab import GiB, KiB, get_model
from kvlab.capacity.budget import plan_kv_cache
from kvlab.capacity.models import parameter_parts, params_bytes, weights_bytes
from kvlab.capacity.parallel import plan_parallel, weights_bytes_per_gpu
from kvlab.capacity.sizing import kv_bytes_per_token
from kvlab.errors import KvlabValueError, UnknownNameError

DS = get_model("deepseek-v3")
H200 = dict(num_gpus=8, gpu_memory_gib=141, max_model_len=32768)


def test_under_tp_each_gpu_keeps_the_whole_latent_so_the_deployment_holds_24_requests_not_192():
    tp = plan_parallel(DS, "tp", weights_gib=625 / 8, block_size=64, **H200)        # the source's figures
    pooled = plan_kv_cache(DS, gpu_memory_gib=8 * 141, weights_gib=625, max_model_len=32768, block_size=64)
    assert tp.per_gpu.kv_bytes_per_token == tp.kv_bytes_per_token == 68.625 * KiB   # TP does not shrink it
    assert (tp.requests, pooled.concurrency) == (24, 192) and pooled.concurrency // 8 == tp.requests
    assert tp.kv_copies == 8 and tp.stored_bytes_per_token == 8 * 68.625 * KiB


def test_gqa_under_tp_splits_its_heads_so_each_token_is_stored_once():
    llama = plan_parallel("llama-3-70b", "tp", num_gpus=8, gpu_memory_gib=80, max_model_len=8192)
    assert llama.per_gpu.kv_bytes_per_token * 8 == kv_bytes_per_token(get_model("llama-3-70b")) == 320 * KiB
    assert llama.kv_copies == 1


def test_dp_attention_stores_each_latent_once_and_pays_with_replicated_attention_weights():
    tp, dp = (plan_parallel(DS, layout, **H200) for layout in ("tp", "dp_attention"))
    parts = parameter_parts(DS.config)
    routed = parts["routed_experts"]
    assert dp.per_gpu.weights_bytes == params_bytes(DS.num_params - routed, "fp8") + params_bytes(routed, "fp8") // 8
    assert tp.per_gpu.weights_bytes == weights_bytes(DS) // 8 < dp.per_gpu.weights_bytes
    assert dp.kv_copies == 1 and dp.per_gpu.concurrency < tp.per_gpu.concurrency      # each pool is smaller...
    assert dp.requests == 8 * dp.per_gpu.concurrency > 5 * tp.requests               # ...but they add up
    assert dp.requests < plan_kv_cache(DS, gpu_memory_gib=8 * 141, weights_gib=weights_bytes(DS) / GiB,
                                       max_model_len=32768).concurrency             # not the pooled arithmetic


def test_bad_layouts_and_uncountable_models_are_refused_by_name():
    with pytest.raises(UnknownNameError, match="layout"):
        plan_parallel(DS, "pp", **H200)
    with pytest.raises(KvlabValueError, match="num_gpus"):
        weights_bytes_per_gpu(DS, "tp", 0)
    uncounted = DS.__class__.from_hf_config({**DS.config, "model_type": "kimi"}, name="kimi")
    with pytest.raises(KvlabValueError, match="weights_gib"):
        plan_parallel(uncounted, "dp_attention", **H200)
    assert plan_parallel(uncounted, "dp_attention", weights_gib=90, **H200).requests > 0
