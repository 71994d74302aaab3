"""The attention layer that reads and writes the paged KV cache through ``kvlab.kernels``.

Each forward step sees one flat batch of tokens from many requests (vLLM's "varlen" batch).
``AttentionMetadata`` says, for that batch, where each new token's K and V go
(``slot_mapping``) and which physical blocks each request reads (``block_table``,
``seq_lens``, ``query_start_loc``). The layer does two things per step, as vLLM's
attention backends do: write the new K/V into their slots, then attend over each request's
whole cached context.

Which kernels do that is the engine's ``attention_backend`` (``BACKEND_KERNELS``): ``"triton"``
runs kvlab's Triton kernels (native on a GPU, interpreted on a CPU), ``"torch"`` writes with the
torch reference and attends with one batched gather plus SDPA (``paged_attention_torch``). Both read
the same cache through the same block tables and slot mappings; ``Attention.forward`` is the one
place the choice is made.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab import kernels

#: attention_backend -> (cache write, attention), names on ``kvlab.kernels``, looked up at each call
#: (so a test that swaps a kernel there reaches the engine). The torch write is the reference's (one
#: indexed copy): the interpreted Triton write costs milliseconds per layer and step on a CPU, the torch
#: one microseconds. The torch pair also take the step's ``plans``, so that their checks, gather indices
#: and masks are computed by the step's first layer and reused by the others.
BACKEND_KERNELS: dict[str, tuple[str, str]] = {
    "triton": ("reshape_and_cache", "paged_attention"),
    "torch": ("reshape_and_cache_torch", "paged_attention_torch"),
}


@dataclasses.dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer (vLLM's ``FlashAttentionMetadata``, trimmed).

    Request ``i`` contributes the query tokens ``query_start_loc[i]:query_start_loc[i + 1]``;
    they are its *last* tokens, so its context before this step is ``seq_lens[i]`` minus that
    count. That one rule covers a whole prefill, a chunk of one, and a one-token decode.
    """

    slot_mapping: torch.Tensor  # [num_tokens]: block_id * block_size + offset, where each new K/V goes
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq]: physical block ids, in logical order
    seq_lens: torch.Tensor  # [num_seqs]: tokens each request attends to, this step's included
    query_start_loc: torch.Tensor  # [num_seqs + 1]: prefix sums of the per-request query lengths
    #: The host copies of the index tensors (vLLM's ``*_cpu`` fields): the kernels' checks read these,
    #: never the device ones, so they cost no device-to-host synchronisation.
    host: kernels.HostMetadata | None = None
    slot_mapping_cpu: torch.Tensor | None = None  # [num_tokens]
    #: What the torch backend's kernels computed once for this step and every layer reuses (their ``plans``).
    plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def logits_indices(self) -> torch.Tensor:
        """Index of each request's last query token: the only one whose logits may be sampled."""
        return self.query_start_loc[1:].to(torch.int64) - 1  # [num_seqs]


class Attention(torch.nn.Module):
    """Paged attention over one layer's KV cache (``reshape_and_cache`` then ``paged_attention``).

    ``k_scale`` / ``v_scale`` are the per-tensor scales of an FP8 cache (1.0, vLLM's default,
    unless calibrated); for a cache in the model's own dtype they are 1.0 and unused.
    ``kernel_config`` and ``decode_kv_splits`` are kvlab's knobs on the kernel (set through
    ``ModelRunner``): fixed tiles for every step, and a split count forced on decode-only steps.
    ``sliding_window`` W (a sliding-window layer): the query at position q sees keys q - W + 1 .. q,
    and the kernel skips the tiles before that, which is why the block table may hold the null
    block there (the blocks that slid out, freed by ``SlidingWindowManager``).
    ``attention_backend`` names the kernels (``BACKEND_KERNELS``; the torch ones ignore both knobs).
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads, self.scale = num_heads, head_size, num_kv_heads, scale
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kernel_config: kernels.KernelConfig | None = None  # None: the kernel chooses per step
        self.decode_kv_splits: int | None = None  # None: the kernel chooses (on a CPU: 1)
        self.attention_backend = "triton"  # set by ModelRunner from EngineConfig.attention_backend

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        key_cache, value_cache = kv_cache
        decode_only = query.shape[0] == attn_metadata.num_seqs  # one token per request (no device sync needed)
        write, attend = (getattr(kernels, name) for name in BACKEND_KERNELS[self.attention_backend])
        shared = {"plans": attn_metadata.plans} if self.attention_backend == "torch" else {}
        write(key, value, key_cache, value_cache, attn_metadata.slot_mapping,
              k_scale=self.k_scale, v_scale=self.v_scale, slot_mapping_cpu=attn_metadata.slot_mapping_cpu, **shared)
        return attend(
            query,
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            scale=self.scale,
            causal=True,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            num_kv_splits=self.decode_kv_splits if decode_only else None,
            config=self.kernel_config,
            sliding_window=self.sliding_window,
            host_metadata=attn_metadata.host,
            **shared,
        )
