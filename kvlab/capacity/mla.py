"""What MLA's two ways of attending cost, counted: FLOPs and bytes, decompress (naive) against absorb.

Both paths start from the same tensors (``q_nope``, the rotated ``q_pe``, the latent cache of
``c_kv`` and ``k_pe``, the two halves ``W_UK``/``W_UV`` of ``kv_b_proj``) and end with the same
per-head output ``[Sq, N, V]`` before ``o_proj``; ``kvlab.kernels.mla_absorb`` computes both.
Here is what each costs for one layer, for ``num_seqs`` sequences that each run ``query_len``
query tokens after ``context_len`` cached ones (``S = context_len + query_len`` latents, causal):

* naive (vLLM's ``forward_mha``, as its prefill runs it): decompress all ``S`` latents into K
  ``[S, N, P + R]`` (``k_pe`` copied to every head) and V ``[S, N, V]`` in memory, then multi-head
  attention reads them back;
* absorbed (vLLM's ``forward_mqa``, its decode path): ``q_latent = q_nope · W_UK`` (written, read
  back), attention over the latents (each read once for all heads), ``o_latent`` (written, read
  back) times ``W_UV``.

FLOPs count a multiply-add as 2; causal attention counts only the (query, key) pairs a query may
see. Bytes assume every tensor crosses memory once per use and nothing stays in cache between
kernels (an unfused model, the way vLLM's separate kernels run); the weights are read once per
step for the whole batch. The latent cache may be in another dtype (``kv_dtype``) than the
activations and ``W_UK``/``W_UV`` (``act_dtype``; vLLM dequantizes ``kv_b_proj`` to it).

The shapes decide the verdict. Decompressing costs ``2 L N (P + V)`` FLOPs per *key*; absorbing
costs the same per *query*, plus ``2 N (2L + R)`` per (query, key) pair instead of
``2 N (P + R + V)``. With one query token (decode) absorbing wins everything; when the queries
are as many as the keys (a prefill) decompressing needs fewer FLOPs, and a prefill is bound by
FLOPs, not bytes. ``absorb_crossover`` finds where the FLOPs cross for a given context.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from kvlab._validate import checked, non_negative_int, positive_int
from kvlab.capacity.models import ModelSpec
from kvlab.capacity.sizing import dtype_bytes, vector_bytes
from kvlab.errors import KvlabValueError, MissingConfigKeyError, UnknownNameError


@checked
@dataclasses.dataclass(frozen=True)
class MLADims:
    """The shapes of one MLA layer (vLLM's ``MLADims``, plus the head count on this GPU)."""

    num_heads: int                 # N
    kv_lora_rank: int              # L: the latent c_kv
    qk_nope_head_dim: int          # P: the part of q and k without rotary
    qk_rope_head_dim: int          # R: the rotary part, k_pe shared by every head
    v_head_dim: int                # V
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            positive_int(name, getattr(self, name))

    @property
    def latent_size(self) -> int:
        """Values one token caches per layer: ``L + R`` (576 for DeepSeek-V3), vLLM's MLA ``head_size``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """``P + R``: the head size a decompressed query and key have (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@checked
def mla_dims(model: ModelSpec, tp: int = 1) -> MLADims:
    """The MLA shapes of ``model``, read from its ``config.json``; ``tp`` splits the heads across GPUs."""
    if model.attention != "mla":
        raise KvlabValueError(f"model {model.name!r} uses {model.attention.upper()} attention, not MLA")
    cfg = model.config.get("text_config") or model.config
    for key in ("qk_nope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise MissingConfigKeyError(key, where=f"the config of {model.name!r}")
    tp = positive_int("tp", tp)
    if model.num_attention_heads % tp:
        raise KvlabValueError(f"tp={tp} does not divide the {model.num_attention_heads} attention heads")
    return MLADims(num_heads=model.num_attention_heads // tp, kv_lora_rank=model.kv_lora_rank,
                   qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=model.qk_rope_head_dim,
                   v_head_dim=cfg["v_head_dim"], q_lora_rank=cfg.get("q_lora_rank"))


@dataclasses.dataclass(frozen=True)
class PathCost:
    """One way of attending: FLOPs, bytes read and bytes written, for one layer and one step."""

    flops: int
    bytes_read: int
    bytes_written: int

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved: above a GPU's FLOPs / bandwidth ratio the work is compute-bound."""
        return self.flops / (self.bytes_read + self.bytes_written)


@dataclasses.dataclass(frozen=True)
class MLACost:
    """Naive against absorbed for one shape of step."""

    dims: MLADims
    query_len: int
    context_len: int
    num_seqs: int
    naive: PathCost
    absorbed: PathCost

    @property
    def flops_ratio(self) -> float:
        """naive / absorbed FLOPs: above 1, absorbing computes less."""
        return self.naive.flops / self.absorbed.flops

    @property
    def bytes_read_ratio(self) -> float:
        """naive / absorbed bytes read: above 1, absorbing reads less."""
        return self.naive.bytes_read / self.absorbed.bytes_read

    @property
    def fewer_flops(self) -> str:
        """``"naive"`` or ``"absorbed"``: the path with fewer FLOPs (naive on a tie: no weights to fold)."""
        return "absorbed" if self.absorbed.flops < self.naive.flops else "naive"

    @property
    def fewer_bytes_read(self) -> str:
        """``"naive"`` or ``"absorbed"``: the path that reads fewer bytes (naive on a tie).

        Both read every latent once and the same weights, so the verdict is K and V read back
        (``S N (P + R + V)`` values) against ``q_latent`` and ``o_latent`` (``2 Sq N L``): absorbing
        reads less when ``S (P + R + V) > 2 L Sq``, whatever the dtypes.
        """
        return "absorbed" if self.absorbed.bytes_read < self.naive.bytes_read else "naive"


@checked
def causal_pairs(query_len: int, context_len: int) -> int:
    """(query, key) pairs causal attention scores: query ``i`` sees ``context_len + i + 1`` keys."""
    return query_len * context_len + query_len * (query_len + 1) // 2


def _naive(d: MLADims, sq: int, s: int, pairs: int, latent: int, a: Fraction) -> tuple[int, Fraction, Fraction]:
    """One sequence's FLOPs, bytes read and written on the naive path (weights excluded)."""
    n, lat, p, r, v = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    flops = 2 * s * lat * n * (p + v) + 2 * pairs * n * (p + r) + 2 * pairs * n * v
    key_value = s * n * (p + r + v) * a                         # K [S, N, P + R] and V [S, N, V]
    read = s * latent + sq * n * (p + r) * a + key_value          # latents, the query, K and V read back
    written = key_value + sq * n * v * a                         # K and V materialised, the output
    return flops, read, written


def _absorbed(d: MLADims, sq: int, pairs: int, s: int, latent: int, a: Fraction) -> tuple[int, Fraction, Fraction]:
    """One sequence's FLOPs, bytes read and written on the absorbed path (weights excluded)."""
    n, lat, p, r, v = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    flops = 2 * sq * n * p * lat + 2 * pairs * n * (lat + r) + 2 * pairs * n * lat + 2 * sq * n * lat * v
    read = (sq * n * p * a                                       # q_nope, to absorb W_UK
            + sq * n * (lat + r) * a + s * latent                # q_latent and q_pe; every latent once
            + sq * n * lat * a)                                  # o_latent, to absorb W_UV
    written = 2 * sq * n * lat * a + sq * n * v * a              # q_latent, o_latent, the output
    return flops, read, written


@checked
def mla_attention_cost(model: ModelSpec | MLADims, query_len: int, context_len: int = 0, *, num_seqs: int = 1,
                       kv_dtype: str = "bf16", act_dtype: str = "bf16", tp: int = 1) -> MLACost:
    """FLOPs and bytes of both paths for one layer: ``num_seqs`` x ``query_len`` queries after ``context_len``."""
    dims = model if isinstance(model, MLADims) else mla_dims(model, tp)
    sq = positive_int("query_len", query_len)
    ctx = non_negative_int("context_len", context_len)
    seqs = positive_int("num_seqs", num_seqs)
    s, pairs = ctx + sq, causal_pairs(sq, ctx)
    latent = vector_bytes(dims.latent_size, kv_dtype)
    try:
        a = dtype_bytes(act_dtype)
    except UnknownNameError as exc:  # dtype_bytes names kv_dtype; the caller passed act_dtype
        raise UnknownNameError("act_dtype", act_dtype, exc.known) from None
    weights = dims.kv_lora_rank * dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim) * a   # W_UK + W_UV
    paths = {}
    for name, (flops, read, written) in (("naive", _naive(dims, sq, s, pairs, latent, a)),
                                         ("absorbed", _absorbed(dims, sq, pairs, s, latent, a))):
        paths[name] = PathCost(flops=seqs * flops, bytes_read=int(seqs * read + weights),
                               bytes_written=int(seqs * written))
    return MLACost(dims, sq, ctx, seqs, paths["naive"], paths["absorbed"])


@checked
def absorb_crossover(model: ModelSpec | MLADims, context_len: int, max_query_len: int = 1 << 20) -> int | None:
    """The fewest query tokens (after ``context_len`` cached) for which naive needs no more FLOPs than absorbed.

    Below it absorbing computes less (decode); from it on decompressing does (prefill). None if
    absorbing still wins at ``max_query_len``. FLOPs grow monotonically in the query length, so
    a binary search finds it.
    """
    non_negative_int("context_len", context_len)

    def naive_wins(sq: int) -> bool:
        return mla_attention_cost(model, sq, context_len).fewer_flops == "naive"

    if not naive_wins(positive_int("max_query_len", max_query_len)):
        return None
    lo, hi = 1, max_query_len
    while lo < hi:
        mid = (lo + hi) // 2
        if naive_wins(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
