"""The embedding and the LM head split by vocabulary, as ``vllm/model_executor/layers/vocab_parallel_embedding.py``.

Under tensor parallelism vLLM splits both by token id: the vocabulary is padded to a multiple of 64
(``pad_vocab_size``) and rank ``r`` holds rows ``[r * V' / tp, (r + 1) * V' / tp)`` of the padded table.

* ``VocabParallelEmbedding``: each rank looks up the ids it owns (``get_masked_input_and_mask``), writes
  zeros for the others, and an all-reduce sums the ranks' rows: every token's row came from exactly one rank.
* ``ParallelLMHead``: each rank multiplies the hidden states by its rows, giving its slice of the logits;
  an all-gather puts the slices side by side (``LogitsProcessor._gather_logits``: vLLM's platforms use
  all-gather, so every rank holds the whole logits and can sample) and the padding is cut off.

Without tensor parallelism kvlab keeps the table unpadded (vLLM pads it anyway), so a one-rank model is
the plain ``nn.Embedding`` it always was. A tied LM head is the embedding itself, shard for shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.distributed.parallel_state import GroupCoordinator
from kvlab.engine.linear import divide, single_rank

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``.
DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (token ids) are split across ranks; ``forward`` looks up and all-reduces."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group or single_rank()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.org_vocab_size, self.embedding_dim = num_embeddings, embedding_dim
        padded = num_embeddings if self.tp_size == 1 else pad_vocab_size(num_embeddings)
        self.num_embeddings_padded = padded
        self.num_embeddings_per_partition = divide(padded, self.tp_size, "padded vocab_size / tensor_parallel_size")
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        self.weight.checkpoint_shape = (num_embeddings, embedding_dim)  # type: ignore[attr-defined]
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's table; the padding rows stay zero."""
        owned = self.vocab_end_index - self.vocab_start_index
        param.data.zero_()
        param.data[:owned].copy_(loaded[self.vocab_start_index:self.vocab_end_index].to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local = (input_ids - self.vocab_start_index) * owned  # ids this rank does not own look up row 0 ...
        output = F.embedding(local, self.weight)
        output.masked_fill_(~owned.unsqueeze(-1), 0)  # ... and are zeroed: exactly one rank gives each row
        return self.tp_group.all_reduce(output)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head split like the embedding: each rank's logits for its token ids, gathered into the whole row."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return lm_head_logits(self, hidden_states)


def lm_head_logits(head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden_states @ W^T`` over this rank's rows, all-gathered across ranks, padding cut, in float32."""
    local = hidden_states @ head.weight.T  # [n, vocab / tp (padded)]
    logits = head.tp_group.all_gather(local, dim=-1)  # [n, padded vocab]
    return logits[..., :head.org_vocab_size].to(torch.float32)
