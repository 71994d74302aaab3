"""Gemma 3's text decoder on the paged KV cache: the Llama decoder with Gemma's norms, scale, rotations and GeGLU.

vLLM 0.33.0 serves ``gemma3_text`` checkpoints with ``Gemma3ForCausalLM``
(``vllm/model_executor/models/gemma3.py``); transformers' class of the same name is the reference the
tests compare with. What differs from ``LlamaForCausalLM``, each a few lines here:

* every norm is ``GemmaRMSNorm``: it scales by ``1 + weight`` (the checkpoint stores the offset from 1),
  in float32 before casting back;
* a decoder layer norms the attention's and the MLP's *outputs* too (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) before adding them to the residual, and norms the MLP's input with
  ``pre_feedforward_layernorm``;
* q and k are normed per head (``q_norm`` / ``k_norm``), and the softmax scale is
  ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
* sliding layers rotate with their own base (``DecoderConfig.layer_rope``);
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* the embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype first;
* the logits are soft-capped, ``c * tanh(logits / c)``, where ``final_logit_softcapping`` is set.

vLLM fuses the residual add into its norms; kvlab keeps them apart, as transformers writes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.engine.attention import AttentionMetadata
from kvlab.engine.config import DecoderConfig
from kvlab.engine.kv_cache_interface import KVCache
from kvlab.engine.model import LlamaAttention, LlamaForCausalLM, LlamaModel


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32, then cast back (vLLM's ``GemmaRMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))  # the offset from 1: zeros are the identity scale
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3MLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` (``hidden_activation = "gelu_pytorch_tanh"``)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's q/k norms, the layer type's rotation and ``query_pre_attn_scalar``.

    ``bias``: ``attention_bias``, which gives q, k, v and o a bias each (transformers' rule, read from the config).
    """

    def __init__(self, config: DecoderConfig, layer: int, bias: bool) -> None:
        super().__init__(config, qkv_bias=bias, o_bias=bias, sliding_window=config.layer_sliding_window(layer),
                         rope=config.layer_rope(layer), norm=GemmaRMSNorm)


class Gemma3DecoderLayer(nn.Module):
    """``x += post_attn_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))``."""

    def __init__(self, config: DecoderConfig, layer: int, bias: bool) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer, bias)
        self.mlp = Gemma3MLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class Gemma3Model(LlamaModel):
    """Embeddings scaled by ``sqrt(hidden_size)``, Gemma 3's layers, a final ``GemmaRMSNorm``.

    ``LlamaModel.forward`` runs them: layer ``i`` owns ``kv_caches[i]`` and reads its group's metadata.
    """

    def __init__(self, config: DecoderConfig, bias: bool) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, bias) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.normalizer = config.hidden_size**0.5

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``embed(ids) * sqrt(hidden_size)``, the factor rounded to the weights' dtype (as vLLM and transformers)."""
        embeds = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        return embeds * torch.tensor(self.normalizer, dtype=embeds.dtype, device=embeds.device)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder plus the (tied) head; ``compute_logits`` soft-caps where the config says.

    ``load_weights`` and its checks are ``LlamaForCausalLM``'s: the checkpoint's tensor names are the modules'.
    """

    def __init__(self, config: DecoderConfig, *, attention_bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config, attention_bias)
        self.lm_head = self.model.embed_tokens if config.tie_word_embeddings else \
            nn.Embedding(config.vocab_size, config.hidden_size)  # only .weight is used

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size] -> [n, vocab_size]``, soft-capped to ``(-c, c)`` where ``c`` is set, in the model's
        dtype as vLLM's ``LogitsProcessor`` and transformers cap them; then float32."""
        logits = hidden_states @ self.lm_head.weight.T  # [n, vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.to(torch.float32)

