"""What tensor parallelism costs one step: its collectives, their bytes, and their time on a GPU-to-GPU link.

Every decoder layer ends its attention and its MLP with a row-parallel projection (``o_proj``,
``down_proj``; vLLM's ``RowParallelLinear``) whose partial sums one all-reduce adds up, so a step makes
``2 x num_layers`` all-reduces of the step's activations ``[num_tokens, hidden_size]``, one more for the
vocab-parallel embedding, and one all-gather of the vocab-parallel logits ``[num_seqs, vocab / tp]``
(vLLM's ``LogitsProcessor``). A DeepSeek MoE layer also makes one: its experts' partial sums are added
before a single all-reduce. The payload does not shrink as tp grows: every rank holds the whole hidden state.

What crosses each rank's link depends on the algorithm. A ring all-reduce of ``S`` bytes over ``n`` ranks
sends ``2 (n - 1) / n x S`` through every rank in ``2 (n - 1)`` steps; a ring all-gather sends each rank's
slice ``n - 1`` times onward. The time modelled here is those bytes over the link's bandwidth plus
``latency_s`` per ring step: bandwidth alone is a lower bound, and at decode sizes (a few KiB per
all-reduce) the latency term, microseconds per step on NVLink, is nearly all of it. NCCL picks other
algorithms (trees, NVLS) by size and topology; the ring is the textbook case.
"""

from __future__ import annotations

import dataclasses

from kvlab._validate import checked, non_negative_number, one_of, positive_int
from kvlab.capacity.hardware import LinkSpec, get_link
from kvlab.capacity.models import ModelSpec, resolve_model
from kvlab.capacity.sizing import dtype_bytes
from kvlab.errors import KvlabValueError

#: vLLM pads the vocabulary to a multiple of this before splitting it (``DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64
#: The dtypes activations travel in between ranks.
ACTIVATION_DTYPES = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class TPStepCollectives:
    """The collectives one step makes on each of ``tp`` ranks, and the bytes each one hands to them."""

    model: str
    tp: int
    num_tokens: int                  # tokens the step computes (a decode step: one per sequence)
    num_seqs: int                    # sequences sampled (rows of logits)
    activation_bytes: float          # bytes of one activation value (2 for bf16)
    all_reduces: int                 # 2 x num_layers + 1 (the embedding)
    all_reduce_payload_bytes: int    # one all-reduce's tensor: num_tokens x hidden_size x b
    all_gathers: int                 # 1: the logits
    all_gather_payload_bytes: int    # one rank's slice of the logits: num_seqs x padded vocab / tp x b

    @property
    def payload_bytes(self) -> int:
        """The bytes every rank hands to its collectives in one step (what kvlab's ranks count)."""
        return self.all_reduces * self.all_reduce_payload_bytes + self.all_gathers * self.all_gather_payload_bytes

    @property
    def wire_bytes_per_rank(self) -> float:
        """Bytes each rank sends over its link in one step, with ring algorithms (0 on one rank)."""
        n = self.tp
        return (self.all_reduces * 2 * (n - 1) / n * self.all_reduce_payload_bytes
                + self.all_gathers * (n - 1) * self.all_gather_payload_bytes)

    @property
    def ring_steps(self) -> int:
        """Sequential hops in one step's collectives: ``2 (n - 1)`` per all-reduce, ``n - 1`` per all-gather."""
        n = self.tp
        return self.all_reduces * 2 * (n - 1) + self.all_gathers * (n - 1)

    def seconds(self, link: str | LinkSpec, latency_s: float = 0.0) -> float:
        """Modelled time of the step's collectives on ``link``: wire bytes / bandwidth + ``latency_s`` per ring step."""
        latency = non_negative_number("latency_s", latency_s)
        return self.wire_bytes_per_rank / get_link(link).bytes_per_s + self.ring_steps * latency


@checked
def tp_step_collectives(model: ModelSpec | str, tp: int, num_seqs: int, num_tokens: int | None = None,
                        activation_dtype: str = "bf16") -> TPStepCollectives:
    """The collectives of one step of ``model`` split over ``tp`` ranks: ``num_seqs`` sequences sampled from
    ``num_tokens`` computed tokens (by default one each: a decode step), activations in ``activation_dtype``."""
    spec = resolve_model(model)
    tp, num_seqs = positive_int("tp", tp), positive_int("num_seqs", num_seqs)
    num_tokens = num_seqs if num_tokens is None else positive_int("num_tokens", num_tokens)
    if num_tokens < num_seqs:
        raise KvlabValueError(f"num_tokens={num_tokens} < num_seqs={num_seqs}: each sequence computes a token")
    cfg = spec.config.get("text_config") or spec.config
    hidden = spec.hidden_size or cfg.get("hidden_size")
    vocab = cfg.get("vocab_size")
    if not isinstance(hidden, int) or not isinstance(vocab, int):
        raise KvlabValueError(f"model {spec.name!r}: its config needs hidden_size and vocab_size to count the "
                              "collectives' bytes")
    b = dtype_bytes(one_of("activation_dtype", activation_dtype, ACTIVATION_DTYPES))
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING if tp > 1 else vocab
    all_reduces = 2 * spec.num_layers + 1 if tp > 1 else 0
    all_gathers = 1 if tp > 1 else 0
    return TPStepCollectives(
        model=spec.name, tp=tp, num_tokens=num_tokens, num_seqs=num_seqs, activation_bytes=float(b),
        all_reduces=all_reduces, all_reduce_payload_bytes=int(num_tokens * hidden * b),
        all_gathers=all_gathers, all_gather_payload_bytes=int(num_seqs * (padded // tp) * b))
