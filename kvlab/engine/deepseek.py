"""A DeepSeek-V3-style decoder whose attention is MLA on the paged latent cache.

The module and parameter names are the checkpoint's (transformers 5 writes them), so
``model.layers.1.self_attn.kv_b_proj.weight`` loads into exactly that module; the class names
are vLLM's (``DeepseekV2ForCausalLM`` > ``DeepseekV2Model`` > ``DeepseekV2DecoderLayer`` >
``DeepseekV2MLAAttention`` / ``DeepseekV2MoE``, ``vllm/model_executor/models/deepseek_v2.py``).
The forward takes vLLM's flat batch (``input_ids``, ``positions``, ``AttentionMetadata``) and
one latent cache per layer.

The mixture of experts is computed plainly in torch: the router in float32 exactly as
transformers does (sigmoid scores plus the correction bias choose, the raw scores weigh), then
each chosen expert over its tokens, one expert after another. vLLM runs fused MoE kernels with
expert parallelism; the point here is attention and the cache, and the MoE only has to give the
same numbers as transformers.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.engine.attention import AttentionMetadata
from kvlab.engine.deepseek_config import DeepseekConfig
from kvlab.engine.deepseek_rope import DeepseekRotaryEmbedding
from kvlab.engine.linear import ColumnParallelLinear, RowParallelLinear, divide, single_rank
from kvlab.engine.loader import check_before_loading, read_weights
from kvlab.engine.mla import MLAAttention
from kvlab.engine.model import LlamaForCausalLM, RMSNorm
from kvlab.engine.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from kvlab.errors import KvlabValueError


class DeepseekV2MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``: the dense layers' MLP, and each expert.

    Under tensor parallelism each rank keeps ``intermediate_size / tp`` of it (gate and up column-parallel,
    down row-parallel); an expert leaves its partial sum unreduced (``reduce_results=False``) and the MoE
    sums every expert's before one all-reduce, as vLLM's ``DeepseekV2MoE`` does.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, tp_group: GroupCoordinator | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, False, tp_group)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, False, tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp_group, reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV2Gate(nn.Module):
    """The router: which ``num_experts_per_tok`` experts each token goes to, and with what weights."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))   # float32 always
        # a fixed per-expert offset learned outside back-propagation; a Parameter, as vLLM keeps it
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])`` for hidden states ``[T, hidden_size]``."""
        c = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()                    # [T, E]
        choice = scores + self.e_score_correction_bias
        per_group = c.n_routed_experts // c.n_group
        group_scores = choice.view(-1, c.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)   # [T, G]
        groups = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        allowed = group_mask.unsqueeze(-1).expand(-1, c.n_group, per_group).reshape(-1, c.n_routed_experts)
        choice = choice.masked_fill(~allowed.bool(), float("-inf"))
        experts = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]        # [T, k]
        weights = scores.gather(1, experts)                                                   # the raw scores weigh
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts


class DeepseekV2MoE(nn.Module):
    """Routed experts (``experts.<e>.*_proj``, as DeepSeek's checkpoints and transformers' files name them),
    each over the tokens routed to it, plus the shared ones, always on."""

    def __init__(self, config: DeepseekConfig, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group or single_rank()
        self.gate = DeepseekV2Gate(config)  # replicated: every rank routes every token the same way
        self.experts = nn.ModuleList(DeepseekV2MLP(config.hidden_size, config.moe_intermediate_size, tp_group, False)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = DeepseekV2MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                            tp_group, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        weights, experts = self.gate(x)                                                    # [T, k] each
        routed = torch.zeros_like(x)
        for e in experts.unique().tolist():                                                # ascending, as transformers
            token, slot = torch.where(experts == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            routed[token] += y.to(routed.dtype)            # each token once per expert (index_add_ is slow on CPU)
        return self.tp_group.all_reduce(routed + self.shared_experts(x))  # one all-reduce for all the experts


class DeepseekV2MLAAttention(nn.Module):
    """Project to the query, the latent and ``k_pe``; normalise; rotate; MLA over the cache; project out.

    Under tensor parallelism the heads split (``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` column-parallel,
    ``o_proj`` row-parallel), but the latent does not: ``kv_a_proj_with_mqa`` is replicated, every rank
    computes and caches the whole ``c_kv`` and ``k_pe`` of every token (vLLM's ``MLAAttentionSpec``,
    ``max_tp_shards = 1``). So each rank's cache is as large as one GPU's without TP.
    """

    def __init__(self, config: DeepseekConfig, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        d, h = config.mla, config.hidden_size
        tp_group = tp_group or single_rank()
        local = divide(d.num_heads, tp_group.world_size, "num_attention_heads / tensor_parallel_size")
        self.dims = dataclasses.replace(d, num_heads=local)  # this rank's heads
        n = d.num_heads  # the layers below take the whole model's sizes and keep this rank's part
        if d.q_lora_rank:
            self.q_a_proj = nn.Linear(h, d.q_lora_rank, bias=False)  # replicated
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(d.q_lora_rank, n * d.qk_head_dim, False, tp_group)
        else:
            self.q_proj = ColumnParallelLinear(h, n * d.qk_head_dim, False, tp_group)
        self.kv_a_proj_with_mqa = nn.Linear(h, d.latent_size, bias=False)  # replicated: the latent is whole
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(d.kv_lora_rank, n * (d.qk_nope_head_dim + d.v_head_dim), False,
                                              tp_group)  # rows are head-major: a row slice is a head slice
        self.o_proj = RowParallelLinear(n * d.v_head_dim, h, False, tp_group)
        self.rotary_emb = DeepseekRotaryEmbedding(config.rope, d.qk_rope_head_dim)
        self.mla_attn = MLAAttention(self.dims, config.scale)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        d, num_tokens = self.dims, hidden_states.shape[0]
        if d.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(num_tokens, d.num_heads, d.qk_head_dim)                                  # [T, N, P + R]
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)                                                    # [T, L]
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)                                 # [T, N, R], [T, R]
        out = self.mla_attn(torch.cat([q_nope, q_pe], dim=-1), kv_c, k_pe, kv_cache, attn_metadata,
                            self.kv_b_proj.weight)                                          # [T, N, V]
        return self.o_proj(out.reshape(num_tokens, d.num_heads * d.v_head_dim))


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x += mla(norm(x)); x += mlp_or_moe(norm(x))``."""

    def __init__(self, config: DeepseekConfig, layer: int, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV2MLAAttention(config, tp_group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.is_moe_layer(layer)
        self.mlp = DeepseekV2MoE(config, tp_group) if moe else \
            DeepseekV2MLP(config.hidden_size, config.intermediate_size, tp_group)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache,
                                                       attn_metadata)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DeepseekV2Model(nn.Module):
    """Embedding, the decoder layers (layer ``i`` owns ``kv_caches[i]``), final norm."""

    def __init__(self, config: DeepseekConfig, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, i, tp_group)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden_size]
        if len(kv_caches) != len(self.layers):
            raise KvlabValueError(f"kv_caches has {len(kv_caches)} entries; the model has {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class DeepseekV2ForCausalLM(nn.Module):
    """The decoder plus the language-model head; ``forward`` then ``compute_logits``, as in vLLM."""

    def __init__(self, config: DeepseekConfig, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group or single_rank()
        self.model = DeepseekV2Model(config, self.tp_group)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp_group)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` of the flat batch; the latents are written to ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    #: ``[n, hidden_size] -> [n, vocab_size]`` in float32, and the checkpoint copied into the parameters of
    #: the same names (every one required and every tensor used, shapes and dtypes checked): as the Llama's.
    compute_logits = LlamaForCausalLM.compute_logits
    load_weights = LlamaForCausalLM.load_weights
    check_weights = LlamaForCausalLM.check_weights


def load_deepseek(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                  config: DeepseekConfig | None = None, tp_group: Any = None, *, check: bool = True,
                  load: bool = True) -> DeepseekV2ForCausalLM | None:
    """Build the decoder ``config.json`` describes and fill it from the checkpoint's safetensors.

    ``config`` is the checkpoint's ``DeepseekConfig`` if the caller read it already. The routers stay
    in float32 whatever ``dtype`` (transformers keeps ``gate.weight`` and the
    correction bias in float32 too). On CPU keep ``float32``: the Triton interpreter has no bf16.
    """
    config = config or DeepseekConfig.from_pretrained(model_dir)
    if check:
        check_before_loading(model_dir, config, lambda: DeepseekV2ForCausalLM(config, tp_group))
    if not load:
        return None
    model = DeepseekV2ForCausalLM(config, tp_group)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, DeepseekV2Gate):
            module.float()
    weights, sources = read_weights(model_dir)
    model.load_weights(weights, sources={name: str(path) for name, path in sources.items()},
                       config_file=str(Path(model_dir) / "config.json"))
    return model.eval()
