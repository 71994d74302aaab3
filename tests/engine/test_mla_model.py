"""kvlab's DeepSeek-V3 decoder reads real configs and checkpoints and computes what transformers does, on latents."""

import json

import pytest
import torch
from kvlab.kernels import compute_slot_mapping, concat_and_cache_mla, default_device, dequantize_fp8, quantize_fp8
from kvlab.kernels.mla_absorb import naive_attention, split_kv_b_proj
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from kvlab import KiB, get_model, kv_bytes_per_token
from kvlab.capacity.mla import MLADims, mla_dims
from kvlab.data import DATA_DIR
from kvlab.engine import AttentionMetadata
from kvlab.engine.deepseek import DeepseekV2MoE, load_deepseek
from kvlab.engine.deepseek_config import DeepseekConfig
from kvlab.engine.deepseek_rope import DeepseekRotaryEmbedding, deepseek_rope, yarn_inv_freq
from kvlab.engine.evaluation import relative_error
from kvlab.engine.mla import MLAAttention, allocate_mla_kv_caches
from kvlab.engine.toy import random_token_ids
from kvlab.errors import ConfigFieldError, KvlabValueError, MissingConfigKeyError, UnknownNameError

DSV3_JSON = json.loads((DATA_DIR / "models" / "deepseek-v3.json").read_text())


def hf_config(cfg):
    return DeepseekV3Config(**{k: v for k, v in cfg.items() if not k.startswith("_")})


def paged_logits(model, token_ids, chunks, block_ids=(3, 0, 5, 1, 4), block_size=16):
    """One sequence through fresh latent caches, chunk by chunk (each chunk reads the ones before from the cache)."""
    device = default_device()
    model.to(device)
    caches = allocate_mla_kv_caches(model.config.mla, model.config.num_hidden_layers, max(block_ids) + 1, block_size,
                                    device=device)
    table = torch.tensor([list(block_ids)], dtype=torch.int32, device=device)
    logits, done = [], 0
    for size in chunks:
        pos = torch.arange(done, done + size, device=device)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(slots, table, torch.tensor([done + size], dtype=torch.int32, device=device),
                                 torch.tensor([0, size], dtype=torch.int32, device=device))
        with torch.no_grad():
            ids = torch.tensor(token_ids[done:done + size], device=device)
            logits.append(model.compute_logits(model(ids, pos, caches, meta)).cpu())
        done += size
    return torch.cat(logits), caches


# ----------------------------------------------------------------- config.json


def test_deepseek_v3s_real_config_is_read_in_its_old_rope_spelling():
    config = DeepseekConfig.from_dict(DSV3_JSON)
    assert config.mla == mla_dims(get_model("deepseek-v3"))
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group,
            config.first_k_dense_replace) == (256, 8, 8, 4, 3)
    assert config.rope.rope_type == "yarn" and config.rope.factor == 40 and config.rope.interleave
    expected = hf_ds.yarn_apply_mscale(hf_config(DSV3_JSON).rope_parameters, config.mla.qk_head_dim ** -0.5)
    assert config.scale == expected                                       # 192^-0.5 x (0.1 ln 40 + 1)^2


@pytest.mark.parametrize("which", ["deepseek-v3", "tiny"])
def test_yarn_frequencies_equal_transformers(which, tiny_deepseek_dir):
    cfg = DSV3_JSON if which == "deepseek-v3" else json.loads((tiny_deepseek_dir / "config.json").read_text())
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(cfg))
    ours, factor = yarn_inv_freq(deepseek_rope(cfg), cfg["qk_rope_head_dim"])
    assert torch.equal(ours, expected) and factor == attention_factor


@pytest.mark.parametrize("interleave", [True, False])
def test_the_rotation_equals_transformers_bit_for_bit(interleave, tiny_deepseek_dir):
    cfg = {**json.loads((tiny_deepseek_dir / "config.json").read_text()), "rope_interleave": interleave}
    hf_rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_config(cfg))
    positions = torch.tensor([0, 1, 7, 130, 511])
    q, k = torch.randn(5, 4, 8), torch.randn(5, 8)
    cos, sin = hf_rotary(q, positions[None, :])                                      # [1, T, R]
    apply = hf_ds.apply_rotary_pos_emb_interleave if interleave else hf_ds.apply_rotary_pos_emb
    hf_q, hf_k = apply(q.transpose(0, 1)[None], k[None, None], cos, sin)             # [1, N, T, R], [1, 1, T, R]
    ours_q, ours_k = DeepseekRotaryEmbedding(deepseek_rope(cfg), 8)(positions, q, k)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0, 0])


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"model_type": "llama"}, UnknownNameError, "model_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, UnknownNameError, "rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, MissingConfigKeyError, "factor"),
    ({"scoring_func": "softmax"}, KvlabValueError, "scoring_func"),
    ({"attention_bias": True}, KvlabValueError, "attention_bias"),
    ({"n_group": 3}, KvlabValueError, "n_group"),
    ({"kv_lora_rank": 0}, ConfigFieldError, "kv_lora_rank"),  # the door: 0 is no rank at all
    ({"kv_lora_rank": None}, MissingConfigKeyError, "kv_lora_rank"),
])
def test_variants_kvlab_does_not_compute_are_refused_by_name(tiny_deepseek_dir, change, error, words):
    config = json.loads((tiny_deepseek_dir / "config.json").read_text())
    with pytest.raises(error, match=words):
        DeepseekConfig.from_dict({**config, **change})


# ----------------------------------------------------------------- the latent pool


def test_the_allocated_latent_pool_holds_what_kv_bytes_per_token_computes(tiny_deepseek_dir):
    config = DeepseekConfig.from_pretrained(tiny_deepseek_dir)
    caches = allocate_mla_kv_caches(config.mla, config.num_hidden_layers, num_blocks=10, block_size=16)
    per_token = sum(c.numel() * c.element_size() for c in caches) // (10 * 16)
    assert per_token == kv_bytes_per_token(config.spec, "fp32") == 2 * (32 + 8) * 4
    # DeepSeek-V3 in bf16, on the meta device (nothing allocated): 61 layers x 576 values x 2 bytes
    dsv3 = DeepseekConfig.from_dict(DSV3_JSON)
    caches = allocate_mla_kv_caches(dsv3.mla, dsv3.num_hidden_layers, 1, 1, dtype=torch.bfloat16, device="meta")
    assert sum(c.numel() * c.element_size() for c in caches) == kv_bytes_per_token(dsv3.spec) == 68.625 * KiB


# ----------------------------------------------------------------- weights and the forward


def test_the_checkpoint_loads_into_modules_of_the_same_names(tiny_deepseek_dir, hf_deepseek):
    model = load_deepseek(tiny_deepseek_dir)
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, tensor in hf_deepseek.state_dict().items():
        if ".experts." not in name:                     # transformers stacks the experts in memory
            assert torch.equal(ours[name], tensor), name
    assert torch.equal(ours["model.layers.1.mlp.experts.2.up_proj.weight"],
                       hf_deepseek.model.layers[1].mlp.experts.gate_up_proj[2, 32:])
    assert ours["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_a_checkpoint_missing_a_tensor_or_of_another_shape_is_refused(tiny_deepseek_dir):
    model = load_deepseek(tiny_deepseek_dir)
    weights = dict(model.state_dict())
    with pytest.raises(KvlabValueError, match="lacks 1 tensor"):
        model.load_weights({k: v for k, v in weights.items() if "kv_b_proj" not in k or ".0." not in k})
    with pytest.raises(KvlabValueError, match="kv_a_layernorm.weight has shape"):
        model.load_weights({**weights, "model.layers.0.self_attn.kv_a_layernorm.weight": torch.ones(31)})


def test_the_moe_layer_equals_transformers(tiny_deepseek_dir, hf_deepseek):
    model = load_deepseek(tiny_deepseek_dir)
    x = torch.randn(40, 64)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, DeepseekV2MoE)
    with torch.no_grad():
        assert relative_error(moe(x), hf_deepseek.model.layers[1].mlp(x[None])[0]) < 1e-6


@pytest.mark.parametrize("chunks", [[70], [30, 25, 15], [40, 1, 1, 28]], ids=["whole", "chunked", "decodes"])
def test_logits_equal_transformers_whole_chunked_or_decoded(tiny_deepseek_dir, hf_deepseek, chunks):
    # 70 tokens over blocks of 16 in scattered order; a chunk after the first reads its context from the
    # cache (decompressed), a 1-token step goes through the absorbed Triton decode kernel
    prompt = random_token_ids(70, seed=3)
    ours, _ = paged_logits(load_deepseek(tiny_deepseek_dir), prompt, chunks)
    with torch.no_grad():
        expected = hf_deepseek(torch.tensor([prompt])).logits[0]
    assert relative_error(ours, expected) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_mla_layer_decodes_and_prefills_one_mixed_batch_as_the_naive_formula(cache_dtype):
    # request 0 decodes its 21st token, request 1 prefills 6 tokens after 10 cached ones; FP8 latents with a scale
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    device, g = default_device(), torch.Generator().manual_seed(0)
    layer = MLAAttention(dims, scale=0.2)
    layer.k_scale = 0.05 if cache_dtype == torch.float8_e4m3fn else 1.0
    latents = [torch.randn(n, dims.latent_size, generator=g) for n in (21, 16)]            # every latent, rotated
    cache = torch.zeros(6, 8, dims.latent_size, device=device).to(cache_dtype)
    table = torch.tensor([[4, 0, 2], [1, 5, 0]], dtype=torch.int32, device=device)
    for i, (n, new) in enumerate(((21, 1), (16, 6))):                                   # the context, already cached
        kernels_write(latents[i][: n - new], table[i], cache, layer.k_scale)
    q = torch.randn(7, 4, dims.qk_head_dim, generator=g)
    new = torch.cat([latents[0][20:], latents[1][10:]])                                  # this step's 7 tokens
    seq_lens = torch.tensor([21, 16], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1, 7], dtype=torch.int32, device=device)
    slots = compute_slot_mapping(table, seq_lens, query_start_loc, 8)       # 2 * 8 + 4, then 5 * 8 + 2 ..
    meta = AttentionMetadata(slots, table, seq_lens, query_start_loc)
    weight = torch.randn(4 * 32, 32, generator=g) / 32**0.5
    out = layer(q.to(device), new[:, :32].to(device), new[:, 32:].to(device), cache, meta, weight.to(device)).cpu()
    w_uk, w_uv = split_kv_b_proj(weight, 4, 16, 16)
    for rows, lat in ((slice(0, 1), latents[0]), (slice(1, 7), latents[1])):
        if cache_dtype == torch.float8_e4m3fn:
            lat = dequantize_fp8(quantize_fp8(lat, layer.k_scale), layer.k_scale)        # what the cache holds
        expected = naive_attention(q[rows, :, :16], q[rows, :, 16:], lat[:, :32], lat[:, 32:], w_uk, w_uv, 0.2)
        assert relative_error(out[rows], expected) < 1e-5


def kernels_write(latents, block_row, cache, k_scale):
    """Write one request's first latents through its block-table row (positions 0, 1, ...)."""
    block_size = cache.shape[1]
    pos = torch.arange(latents.shape[0], device=cache.device)
    slots = block_row[pos // block_size].long() * block_size + pos % block_size
    latents = latents.to(cache.device)
    concat_and_cache_mla(latents[:, :32], latents[:, 32:], cache, slots, k_scale=k_scale)
