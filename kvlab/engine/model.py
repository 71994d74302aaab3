"""A Llama-family decoder whose attention runs on the paged KV cache: small enough to read in one sitting.

The class and attribute names are vLLM's (``LlamaForCausalLM`` > ``LlamaModel`` >
``LlamaDecoderLayer`` > ``LlamaAttention`` / ``LlamaMLP``) and the parameter names are the
checkpoint's, so ``model.layers.3.self_attn.q_proj.weight`` loads into exactly that module.
Where vLLM fuses (``qkv_proj``, ``gate_up_proj``, a fused residual-add RMSNorm) kvlab keeps the
separate, unfused operations: slower, but each line is one idea and the numerics are those
of the Hugging Face reference, which the tests compare against.

The forward takes vLLM's flat batch: ``input_ids [num_tokens]`` and ``positions [num_tokens]``
from many requests at once, with ``AttentionMetadata`` saying which request each token
belongs to. No layer ever sees a padded ``[batch, seq]`` tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.engine.attention import Attention, AttentionMetadata
from kvlab.engine.config import DecoderConfig, RopeConfig
from kvlab.engine.kv_cache_interface import KVCache
from kvlab.engine.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint_shape,
    load_weight,
    qkv_partition,
    single_rank,
)
from kvlab.engine.rope import RotaryEmbedding
from kvlab.engine.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from kvlab.errors import CheckpointError, KvlabValueError


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 == self.weight.dtype:  # torch's fused kernel: the same arithmetic, bit for bit
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x if dtype == torch.float32 else x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x if dtype == torch.float32 else x.to(dtype))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; under tensor parallelism gate and up split their outputs
    (column-parallel), down its inputs (row-parallel), so each rank keeps ``intermediate_size / tp`` and one
    all-reduce sums the ranks' ``down``."""

    def __init__(self, config: DecoderConfig, bias: bool = False, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = ColumnParallelLinear(h, i, bias, tp_group)
        self.up_proj = ColumnParallelLinear(h, i, bias, tp_group)
        self.down_proj = RowParallelLinear(i, h, bias, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    """Project to q, k, v; (Qwen3, Gemma 3: normalise each head); rotate; paged attention; project out.

    ``rope`` is the layer's rotation (by default ``config.rope``; Gemma 3's sliding layers have their own) and
    ``norm`` the q/k norm's class (Gemma 3's scales by ``1 + weight``). Under tensor parallelism each rank keeps
    ``num_heads / tp`` query heads and their KV heads (``qkv_partition``; replicated when there are fewer KV heads
    than ranks), attends over its own heads in its own KV cache, and ``o_proj`` (row-parallel) sums the ranks'
    outputs.
    """

    def __init__(self, config: DecoderConfig, qkv_bias: bool = False, o_bias: bool = False,
                 sliding_window: int | None = None, rope: RopeConfig | None = None,
                 norm: type[nn.Module] = RMSNorm, tp_group: GroupCoordinator | None = None,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        tp_group = tp_group or single_rank()
        part = qkv_partition(config.num_attention_heads, config.num_key_value_heads, tp_group.world_size)
        self.num_heads, self.num_kv_heads = part.num_heads, part.num_kv_heads  # this rank's
        self.num_kv_head_replicas = part.num_kv_head_replicas
        self.head_dim = d = config.head_dim
        h, total_q, total_kv = config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d
        self.q_proj = ColumnParallelLinear(h, total_q, qkv_bias, tp_group)
        self.k_proj = ColumnParallelLinear(h, total_kv, qkv_bias, tp_group, num_replicas=part.num_kv_head_replicas)
        self.v_proj = ColumnParallelLinear(h, total_kv, qkv_bias, tp_group, num_replicas=part.num_kv_head_replicas)
        self.o_proj = RowParallelLinear(total_q, h, o_bias, tp_group)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        # the model's, shared by its layers (a step's angles once), unless this layer rotates its own way
        self.rotary_emb = rotary_emb or RotaryEmbedding(rope or config.rope, self.head_dim)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=config.attention_scale,
                              sliding_window=sliding_window)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, config: DecoderConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 sliding_window: int | None = None, tp_group: GroupCoordinator | None = None,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, sliding_window, tp_group=tp_group,
                                        rotary_emb=rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, mlp_bias, tp_group)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (layer ``i`` owns ``kv_caches[i]``), final norm.

    Layer ``i`` slides if ``config.layer_types[i]`` says so (Mistral, Ministral). The attention
    metadata is one for every layer, or one per layer: a hybrid model's groups have block tables
    of their own, so a layer reads its group's (the runner hands each layer its group's metadata).
    """

    def __init__(self, config: DecoderConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group)
        rotary_emb = RotaryEmbedding(config.rope, config.head_dim)  # one for every layer: a step's angles once
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, o_bias, mlp_bias, config.layer_sliding_window(i), tp_group, rotary_emb)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens] -> [num_tokens, hidden_size]``: the token embeddings (vLLM's name)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if len(kv_caches) != len(self.layers):
            raise KvlabValueError(f"kv_caches has {len(kv_caches)} entries; the model has {len(self.layers)} layers")
        per_layer = [attn_metadata] * len(self.layers) if isinstance(attn_metadata, AttentionMetadata) else \
            list(attn_metadata)
        if len(per_layer) != len(self.layers):
            raise KvlabValueError(f"attn_metadata has {len(per_layer)} entries; the model has {len(self.layers)} "
                                  "layers")
        hidden_states = self.embed_input_ids(input_ids)
        for layer, kv_cache, metadata in zip(self.layers, kv_caches, per_layer, strict=True):
            hidden_states = layer(positions, hidden_states, kv_cache, metadata)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the language-model head; ``forward`` then ``compute_logits``, as in vLLM.

    ``tp_group``: this rank's tensor-parallel group (``kvlab.distributed.parallel_state``); by default one rank,
    the whole model. With more, every layer holds this rank's shard and the parameters keep the checkpoint's
    names, so ``load_weights`` narrows each full tensor to the rank's part.
    """

    def __init__(self, config: DecoderConfig, *, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group or single_rank()
        self.model = LlamaModel(config, qkv_bias, o_bias, mlp_bias, self.tp_group)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # one matrix, read both ways
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp_group)  # only .weight is used

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` of the flat batch; K/V are written to ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size] -> [n, vocab_size]`` in float32; under TP each rank's vocabulary slice, all-gathered
        (``kvlab.engine.vocab_parallel_embedding``), so every rank holds the whole row."""
        local = hidden_states @ self.lm_head.weight.T  # [n, vocab / tp]
        return self.tp_group.all_gather(local, dim=-1)[..., :self.config.vocab_size].to(torch.float32)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                     sources: Mapping[str, str] | None = None, config_file: str = "config.json") -> None:
        """Copy checkpoint tensors into the parameters of the same name, after checking all of them.

        Every parameter must be found, every tensor used, every tensor floating point and shaped as
        the config says; otherwise ``CheckpointError`` names the tensor, its file (``sources``) and
        the config fields behind its shape, and no parameter is changed. A tied ``lm_head.weight``
        is skipped, as vLLM skips it: the embedding is the head.
        """
        items = dict(weights.items() if isinstance(weights, Mapping) else weights)
        params = self.check_weights(items, sources=sources, config_file=config_file)
        with torch.no_grad():
            for name, param in params.items():
                load_weight(param, items[name])  # this rank's shard of a tensor-parallel layer

    def check_weights(self, weights: dict[str, torch.Tensor], *, sources: Mapping[str, str] | None = None,
                      config_file: str = "config.json") -> dict[str, torch.nn.Parameter]:
        """``load_weights``' checks alone (meta tensors will do: only names, shapes and dtypes are read); returns
        the parameters to fill, by name. A tied ``lm_head.weight`` leaves ``weights``."""
        params = dict(self.named_parameters(remove_duplicate=False))
        if self.config.tie_word_embeddings:
            params.pop("lm_head.weight", None)
            weights.pop("lm_head.weight", None)
        check_checkpoint_tensors(self.config, {n: checkpoint_shape(p) for n, p in params.items()}, weights,
                                 sources or {}, config_file)
        return params


#: parameter name suffix -> the config fields its shape follows from, dimension by dimension.
_SHAPE_FIELDS = (
    ("embed_tokens.weight", ("vocab_size", "hidden_size")), ("lm_head.weight", ("vocab_size", "hidden_size")),
    ("q_proj.weight", ("num_attention_heads x head_dim", "hidden_size")),
    ("q_proj.bias", ("num_attention_heads x head_dim",)),
    ("k_proj.weight", ("num_key_value_heads x head_dim", "hidden_size")),
    ("k_proj.bias", ("num_key_value_heads x head_dim",)),
    ("v_proj.weight", ("num_key_value_heads x head_dim", "hidden_size")),
    ("v_proj.bias", ("num_key_value_heads x head_dim",)),
    ("o_proj.weight", ("hidden_size", "num_attention_heads x head_dim")), ("o_proj.bias", ("hidden_size",)),
    ("q_norm.weight", ("head_dim",)), ("k_norm.weight", ("head_dim",)),
    ("gate_proj.weight", ("intermediate_size", "hidden_size")), ("gate_proj.bias", ("intermediate_size",)),
    ("up_proj.weight", ("intermediate_size", "hidden_size")), ("up_proj.bias", ("intermediate_size",)),
    ("down_proj.weight", ("hidden_size", "intermediate_size")), ("down_proj.bias", ("hidden_size",)),
    ("norm.weight", ("hidden_size",)),
)


def check_checkpoint_tensors(config: Any, expected: Mapping[str, tuple[int, ...]],
                             tensors: Mapping[str, torch.Tensor], sources: Mapping[str, str], config_file: str) -> None:
    """Refuse, naming file and field, a checkpoint whose tensors disagree with its config (a list of checks).

    ``config`` is a ``DecoderConfig`` or a ``DeepseekConfig``; ``expected`` the model's parameter shapes.
    """
    def where(name: str) -> str:
        return sources.get(name, "the checkpoint")

    check_layer_count(config, tensors, config_file)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) that {config_file} implies, e.g. {missing[:3]}"
        )
    unused = sorted(set(tensors) - set(expected))
    if unused:
        raise CheckpointError(
            f"{where(unused[0])}: {len(unused)} tensor(s) that nothing in the model {config_file} describes would use, "
            f"e.g. {unused[:3]}: is it another architecture, or are config fields wrong?"
        )
    for name, shape in expected.items():
        tensor = tensors[name]
        if not tensor.is_floating_point():
            raise CheckpointError(f"{where(name)}: {name} is {tensor.dtype}; weights must be floating point")
        if tuple(tensor.shape) != shape:
            fields = next((f for suffix, f in _SHAPE_FIELDS if name.endswith(suffix)), ())
            if not isinstance(config, DecoderConfig):
                fields = ()  # these are the Llama's fields; a DeepSeek config names its own
            raise CheckpointError(
                f"{where(name)}: {name} has shape {tuple(tensor.shape)}, but {config_file} implies {shape}"
                f"{f' ({_field_values(config, fields)})' if fields else ''}: one of them is wrong"
            )


def check_layer_count(config: Any, names: Iterable[str], config_file: str) -> None:
    """Refuse a ``num_hidden_layers`` other than the layers the tensor names hold (``model.layers.<i>.``)."""
    parts = [n.split(".") for n in names]
    layers = sorted({int(p[2]) for p in parts if len(p) > 2 and p[:2] == ["model", "layers"] and p[2].isdigit()})
    if layers and layers != list(range(config.num_hidden_layers)):
        raise CheckpointError(
            f"{config_file}: num_hidden_layers is {config.num_hidden_layers}, but the tensors hold layers "
            f"{_ranges(layers)} ({len(layers)} layers)"
        )


def _field_values(config: DecoderConfig, dims: Iterable[str]) -> str:
    """``"num_key_value_heads x head_dim = 2 x 16, hidden_size = 64"`` for the fields behind a shape."""
    return ", ".join(f"{d} = {' x '.join(str(getattr(config, n)) for n in d.split(' x '))}" for d in dims)


def _ranges(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]}" if values == list(range(values[0], values[-1] + 1)) else str(values)
