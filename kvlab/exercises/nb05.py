"""Notebook 05's exercises (the online-softmax update inside a Triton kernel, slot mapping) and self-test.

Importing this module must not import triton (``kvlab.exercises`` imports every notebook's module,
and ``import kvlab`` never touches triton): everything that needs ``kvlab.kernels`` is imported on
first use, and ``tl`` below is bound then.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import random
import warnings
from typing import Any

import torch

from kvlab.errors import BackendUnavailableError
from kvlab.exercises import plain
from kvlab.exercises.core import Case, Exercise, ask, register
from kvlab.units import cdiv, format_bytes

#: ``triton.language``, bound by ``_kernels()`` on first use so the reference below can run as a kernel.
tl: Any = None


def _kernels():
    """Set up kvlab.kernels (and so Triton) on first use; bind ``tl`` for the reference solution."""
    global tl
    kernels = importlib.import_module("kvlab.kernels")
    if tl is None and kernels.backend() != kernels.TORCH_REFERENCE:
        tl = importlib.import_module("triton.language")
    return kernels


# ----------------------------------------------------------------- 05.online_softmax


def online_softmax_update(m_i, l_i, acc, scores, v):
    """Reference: fold one key tile into every row's running max ``m_i``, sum ``l_i`` and ``acc``."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row that has seen no key yet
    alpha = tl.exp(m_i - m_ref)                               # rescales what was summed so far
    p = tl.exp(scores - m_ref[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_new, acc


def _is_stub(fn: Any) -> bool:
    try:
        return "NotImplementedError" in inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return False


@dataclasses.dataclass(frozen=True)
class TileRun:
    """One case of ``05.online_softmax``: the inputs of a one-program tile kernel that calls the learner's update.

    Its repr is what a failure message shows: the shapes of what the update receives, not the
    tensors (16 x 32 numbers say nothing to a reader).
    """

    q: torch.Tensor          # [M, D]
    k: torch.Tensor          # [N, D]
    v: torch.Tensor          # [N, D]
    visible: torch.Tensor    # [M, N] bool
    tile_n: int = 16

    def __repr__(self) -> str:
        (m, d), n = self.q.shape, self.k.shape[0]
        hidden = (~self.visible[:, :self.tile_n]).all(dim=1).nonzero().flatten().tolist()
        late = f"; rows {_ranges(hidden)} see no key in tile 0" if hidden else ""
        return (f"{m} rows x {n} keys in {cdiv(n, self.tile_n)} tiles of {self.tile_n}, so your update gets "
                f"m_i, l_i [{m}], acc [{m}, {d}], scores [{m}, {self.tile_n}], v [{self.tile_n}, {d}]{late}")


def _ranges(rows: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


@dataclasses.dataclass(frozen=True)
class TileOutput:
    """The tile kernel's ``[M, D]`` output, shown as a summary (and, for the learner's, how far each row is off)."""

    out: torch.Tensor
    expected: torch.Tensor | None = None      # the one-go attention, to say which rows differ

    def __repr__(self) -> str:
        rows, dims = self.out.shape
        if self.expected is None:
            norms = self.out.norm(dim=1)
            return f"[{rows}, {dims}] output rows, |row| {float(norms.min()):.3g} .. {float(norms.max()):.3g}"
        return f"[{rows}, {dims}] output: {row_differences(self.out, self.expected)}"


def row_differences(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 5e-3) -> str:
    """Which rows of ``actual`` differ from ``expected``, and how far: 'rows 0-7 off (worst: row 3 by 0.82)'."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    nan_rows = (~torch.isfinite(actual)).any(dim=1)
    error = ((actual - expected).norm(dim=1) / expected.norm(dim=1).clamp(min=1e-12))
    error = torch.where(nan_rows, torch.full_like(error, float("inf")), error)           # [M] relative error per row
    bad = (error > tolerance).nonzero().flatten().tolist()
    if not bad:
        return "every row matches"
    parts = []
    if bool(nan_rows.any()):
        parts.append(f"rows {_ranges(nan_rows.nonzero().flatten().tolist())} hold nan or inf")
    finite_bad = [r for r in bad if not nan_rows[r]]
    if finite_bad:
        worst = max(finite_bad, key=lambda r: float(error[r]))
        parts.append(f"rows {_ranges(finite_bad)} are off (worst: row {worst}, "
                     f"relative error {float(error[worst]):.2g})")
    good = len(error) - len(bad)
    return "; ".join(parts) + (f"; the other {good} rows match" if good else "; no row matches")


def in_tile_kernel(update: Any):
    """Run ``update`` as the online-softmax step of ``attention_by_tiles``: ``(run: TileRun) -> TileOutput``."""
    compiled: list = []

    def run(run: TileRun) -> TileOutput:
        if _is_stub(update):
            raise NotImplementedError("still the stub")
        kernels = _kernels()
        expected = None if update is online_softmax_update else kernels.masked_attention(
            run.q, run.k, run.v, run.visible)
        if kernels.backend() == kernels.TORCH_REFERENCE:
            if update is online_softmax_update:            # the expected answer needs no kernel
                return TileOutput(kernels.masked_attention(run.q, run.k, run.v, run.visible))
            raise BackendUnavailableError("this exercise runs your function in a Triton kernel, and Triton is not "
                                          "installed here (Linux only); the rest of the notebook still runs")
        tiles = importlib.import_module("kvlab.kernels.online_softmax")
        if not compiled:
            compiled.append(tiles.as_kernel_function(update))
        device = kernels.default_device()
        with warnings.catch_warnings():        # a wrong update's nan/inf is reported by the checker, not numpy
            warnings.simplefilter("ignore", RuntimeWarning)
            out = tiles.attention_by_tiles(run.q.to(device), run.k.to(device), run.v.to(device),
                                           run.visible.to(device), run.tile_n, update=compiled[0]).cpu()
        return TileOutput(out, expected)

    return run


def _tile_spec(run: TileRun) -> TileOutput:
    """The specification of a tile case: attention computed in one go, in torch (no kernel to launch)."""
    return TileOutput(_kernels().masked_attention(run.q, run.k, run.v, run.visible))


def _tile_case(rng: random.Random, num_keys: int, *, loud: float = 1.0, late_max: bool = False,
               hidden_start: int = 0, probes: str) -> Case:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.randn(16, 32, generator=g) * loud
    k = torch.randn(num_keys, 32, generator=g)
    v = torch.randn(num_keys, 32, generator=g)
    if late_max:                                    # the last tile's keys point along each query
        k[-8:] += 3.0 * q[rng.randrange(16)] / q.norm(dim=1).mean()
    visible = torch.ones(16, num_keys, dtype=torch.bool)
    visible[:8, :min(hidden_start, num_keys - 1)] = False  # half the rows see nothing in the first tiles,
                                                           # but every row sees its last key at least
    return Case(kwargs={"run": TileRun(q, k, v, visible, 16)}, probes=probes)


def _close(expected: TileOutput, actual: Any) -> bool:
    if not isinstance(actual, TileOutput):
        return False
    out, want = actual.out, expected.out
    if out.shape != want.shape or not torch.isfinite(out).all():
        return False
    return float((out - want).norm() / want.norm()) < 5e-3


def _explain_softmax(case: Case, expected: TileOutput, actual: Any) -> str | None:
    if not isinstance(actual, TileOutput):
        return "return the three updated values (m_new, l_new, acc_new) as a tuple"
    visible = case.kwargs["run"].visible
    first_tile_hidden = bool((~visible[:, :16]).all(dim=1).any())
    if torch.isnan(actual.out).any() and first_tile_hidden:
        return ("a row that has seen no key yet has m = -inf, and -inf - (-inf) is nan: subtract "
                "tl.where(m_new == float('-inf'), 0.0, m_new) instead of m_new")
    if not torch.isfinite(actual.out).all():
        return "exp(score) overflows float32 for scores of a few hundred: subtract the running maximum first"
    return ("when a tile raises a row's maximum, rescale what was summed before (l_i and acc) by "
            "alpha = exp(m_old - m_new)")


register(Exercise(
    id="05.online_softmax",
    title="Puzzle 4: the online-softmax update",
    task=(
        "Write the step that folds one tile of keys into each query row's running softmax, as a "
        "`@triton.jit` function. Per row it keeps `m_i` (largest score so far), `l_i` (sum of "
        "exp(score - m_i)) and `acc` (sum of exp(score - m_i) * v). Given a new tile's `scores` "
        "[M, N] (-inf where a key is masked) and values `v` [N, D], return `(m_new, l_new, acc_new)`. "
        "The checker runs it inside a one-program Triton kernel (`kvlab.kernels.online_softmax`), "
        "on CPU through Triton's interpreter, against attention computed in one go."
    ),
    signature="def online_softmax_update(m_i, l_i, acc, scores, v):",
    reference=online_softmax_update,
    prepare=in_tile_kernel,
    spec=_tile_spec,
    edge_cases=[
        _tile_case(random.Random(1), 12, probes="one tile holds every key: the update runs once"),
        _tile_case(random.Random(2), 48, late_max=True,
                   probes="the largest scores arrive in the last tile, so earlier sums must be rescaled"),
        _tile_case(random.Random(3), 40, loud=40.0,
                   probes="scores of a few hundred: exp(score) overflows unless the running max is subtracted"),
        _tile_case(random.Random(4), 48, hidden_start=20,
                   probes="rows that see no key in the first tile start with m = -inf"),
        _tile_case(random.Random(5), 37, probes="the last tile is only partly filled (masked keys count for nothing)"),
    ],
    random_case=lambda rng: _tile_case(rng, rng.randint(1, 70), loud=rng.choice([0.3, 1.0, 5.0]),
                                       late_max=rng.random() < 0.5, hidden_start=rng.choice([0, 0, 10, 17]),
                                       probes="a random block of rows and keys"),
    num_random=6,
    compare=_close,
    explain=_explain_softmax,
    hints=[
        "Start with m_new = tl.maximum(m_i, tl.max(scores, axis=1)): the row maximum after this tile.",
        "Everything accumulated so far was relative to m_i; alpha = tl.exp(m_i - m_new) converts it to m_new. "
        "New weights are p = tl.exp(scores - m_new[:, None]).",
        "l_new = l_i * alpha + tl.sum(p, axis=1); acc_new = acc * alpha[:, None] + tl.dot(p, v).",
        "Before the first visible key a row has m = -inf, and -inf - (-inf) is nan: subtract "
        "tl.where(m_new == float('-inf'), 0.0, m_new) instead of m_new.",
    ],
))


# ----------------------------------------------------------------- 05.slot_mapping


def slot_mapping(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                 block_size: int) -> list[int]:
    """Reference: the slot of every query token, sequence after sequence."""
    slots = []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens, strict=True):
        for position in range(seq_len - query_len, seq_len):       # the query tokens are the last ones
            slots.append(table[position // block_size] * block_size + position % block_size)
    return slots


def _random_slot_case(rng: random.Random) -> Case:
    block_size = rng.choice([1, 4, 16])
    num_seqs = rng.randint(1, 5)
    seq_lens = [rng.randint(1, 40) for _ in range(num_seqs)]
    query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
    pool = list(range(sum(cdiv(s, block_size) for s in seq_lens) + 10))
    rng.shuffle(pool)
    tables = []
    for s in seq_lens:
        n = cdiv(s, block_size)
        tables.append(pool[:n] + [0] * rng.randint(0, 2))            # padded rows, as vLLM's tensor
        pool = pool[n:]
    return Case((tables, seq_lens, query_lens, block_size), probes="a random mixed batch")


def _explain_slots(case: Case, expected: list[int], actual: Any) -> str | None:
    tables, seq_lens, query_lens, block_size = case.args
    from_zero = slot_mapping(tables, query_lens, query_lens, block_size)
    if type(actual) not in (list, tuple):
        return "return the slots as a list of ints, one per query token, sequence after sequence"
    actual = list(actual)
    if actual == from_zero:
        return ("the query tokens are the *last* query_len tokens of each sequence: positions run "
                "from seq_len - query_len to seq_len - 1, after the cached context")
    no_multiply = [tables[i][p // block_size] + p % block_size
                   for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)) for p in range(s - q, s)]
    if actual == no_multiply:
        return "a slot counts tokens, not blocks: slot = block_id * block_size + offset"
    return None


register(Exercise(
    id="05.slot_mapping",
    title="Slot mapping for a mixed batch",
    task=(
        "Return the slot (`block_id * block_size + offset`) that `reshape_and_cache` writes for every "
        "query token of a batch, sequence after sequence. Sequence i has `seq_lens[i]` tokens and its "
        "`query_lens[i]` query tokens are its last ones (a decode step has 1; a prefill chunk over a "
        "cached prefix starts after it). `block_tables[i]` lists its physical blocks (it may be longer "
        "than needed)."
    ),
    signature=("def slot_mapping(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int], "
               "block_size: int) -> list[int]:"),
    reference=slot_mapping,
    edge_cases=[
        Case(([[7, 3, 12]], [45], [1], 16), probes="one decode step: token 44 sits in logical block 2, offset 12"),
        Case(([[5, 9]], [20], [20], 16), probes="a whole prompt from position 0 crosses a block boundary"),
        Case(([[2, 6, 4]], [40], [10], 16),
             probes="a prefill chunk after 30 cached tokens: positions start at seq_len - query_len"),
        Case(([[1, 0], [3, 0], [8, 2]], [5, 1, 7], [1, 1, 7], 4),
             probes="a mixed batch: two decodes and a new prompt, in the order of the batch"),
        Case(([[4, 9, 0], [4, 6, 0]], [6, 7], [2, 3], 4),
             probes="two sequences share their first block (a prefix hit); each writes only its own new tokens"),
    ],
    random_case=_random_slot_case,
    explain=_explain_slots,
    hints=[
        "For each sequence, the positions of its query tokens are range(seq_len - query_len, seq_len).",
        "Position p lives in logical block p // block_size, at offset p % block_size.",
        "A slot counts token positions in the whole cache: every block before the physical one holds "
        "block_size of them.",
    ],
))


# ----------------------------------------------------------------- 05.legacy_offsets (transfer)

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def legacy_offsets(slot: int, kv_head: int, dim: int, num_kv_heads: int, head_size: int, block_size: int,
                   dtype: str) -> tuple[int, int]:
    """Reference: where one element of one token's K and V sits in vLLM's older CUDA layout (flat indices)."""
    layouts = importlib.import_module("kvlab.kernels.layouts")
    x = layouts.legacy_x(_TORCH_DTYPES[dtype])
    block, offset = divmod(slot, block_size)
    base = (block * num_kv_heads + kv_head) * head_size * block_size   # the (block, head) slice both share
    key = int(layouts.legacy_key_offsets(block_size, head_size, x)[offset, dim])
    value = int(layouts.legacy_value_offsets(block_size, head_size)[offset, dim])
    return base + key, base + value


def _explain_legacy(case: Case, expected: Any, actual: Any) -> str | None:
    slot, kv_head, dim, num_kv_heads, head_size, block_size, dtype = case.args
    if not (type(actual) in (list, tuple) and len(actual) == 2 and all(type(i) is int for i in actual)):
        return "return a pair of ints: (index into the 5-D K cache, index into the 4-D V cache)"
    flash = (slot * num_kv_heads + kv_head) * head_size + dim
    if actual[0] == flash != expected[0]:
        return ("that is the flash layout's index, [num_blocks, block_size, num_kv_heads, head_size]; the older K is "
                "[num_blocks, num_kv_heads, head_size // x, block_size, x]")
    block, t = divmod(slot, block_size)
    with_x = {x: ((block * num_kv_heads + kv_head) * head_size // x + dim // x) * block_size * x + t * x + dim % x
              for x in (4, 8, 16)}
    if actual[0] != expected[0] and actual[0] in with_x.values():
        return (f"x is 16 bytes divided by the element size: {16 // _TORCH_DTYPES[dtype].itemsize} for "
                f"{dtype}, not the same for every dtype")
    if actual[1] == flash != expected[1]:
        return ("V keeps a block's tokens innermost in the older layout: [num_blocks, num_kv_heads, head_size, "
                "block_size], so neighbouring tokens of one dimension sit side by side")
    return None


def _random_legacy_case(rng: random.Random) -> Case:
    num_kv_heads, head_size, block_size = rng.choice([1, 2, 8]), rng.choice([64, 128, 256]), rng.choice([8, 16, 32])
    return Case((rng.randrange(40 * block_size), rng.randrange(num_kv_heads), rng.randrange(head_size), num_kv_heads,
                 head_size, block_size, rng.choice(sorted(_TORCH_DTYPES))), probes="a random element and cache shape")


register(Exercise(
    id="05.legacy_offsets",
    title="An element's address in vLLM's older CUDA layout",
    task=(
        "Section 9 showed the shapes of vLLM's older CUDA cache: K is [num_blocks, num_kv_heads, head_size // x, "
        "block_size, x] with x = 16 bytes / element size, V is [num_blocks, num_kv_heads, head_size, block_size], "
        "both contiguous. A token sits at `slot` (block_id * block_size + offset, as slot_mapping gives it). Return "
        "the flat element indices `(k_index, v_index)` of dimension `dim` of KV head `kv_head` of that token, in a "
        "cache of dtype `dtype` (one of fp32, fp16, bf16, fp8): where the kernel finds it in memory."
    ),
    signature=("def legacy_offsets(slot: int, kv_head: int, dim: int, num_kv_heads: int, head_size: int, "
               "block_size: int, dtype: str) -> tuple[int, int]:"),
    reference=legacy_offsets,
    edge_cases=[
        Case((204, 3, 77, 8, 128, 16, "bf16"), probes="section 4's slot 204 (block 12, offset 12) in bf16: x = 8"),
        Case((204, 3, 77, 8, 128, 16, "fp8"), probes="the same element in an FP8 cache: x = 16, pieces twice as long"),
        Case((204, 3, 77, 8, 128, 16, "fp32"), probes="fp32: x = 4"),
        Case((0, 0, 0, 8, 128, 16, "bf16"), probes="the first element of the cache is at 0 in both layouts"),
        Case((31, 1, 127, 2, 128, 16, "bf16"), probes="the last token and dimension of a block: the end of a slice"),
        Case((9, 0, 33, 1, 64, 4, "fp16"), probes="one KV head (MQA), small blocks"),
    ],
    random_case=_random_legacy_case,
    explain=_explain_legacy,
    transfer=True,
    shown=plain.legacy_offsets,
    hints=[
        "Split the slot into its block and its offset in the block. Both layouts start with [block, head]: "
        "everything of one block and one head is one contiguous slice of head_size * block_size elements.",
        "Inside K's slice the order is [head_size // x, block_size, x]: the piece dim // x, then the token, then "
        "dim % x. Inside V's slice it is [head_size, block_size]: the dimension, then the token.",
        "A contiguous tensor's flat index is built from the outermost index inwards: index = index * size + i, "
        "dimension by dimension.",
    ],
))


# ----------------------------------------------------------------- self-test


def _decode_plan(num_seqs: int, context: int, num_sms: int = 132) -> tuple[Any, Any]:
    """The batch and launch plan of a decode batch with Llama-3-8B's heads (32 query, 8 KV, head 128, bf16)."""
    checks = importlib.import_module("kvlab.kernels.checks")
    batch = checks.AttentionBatch(
        num_tokens=num_seqs, num_q_heads=32, num_kv_heads=8, head_size=128, num_blocks=num_seqs * context // 16,
        block_size=16, query_start_loc=tuple(range(num_seqs + 1)), seq_lens=(context,) * num_seqs, fp8=False,
        scale=128**-0.5, k_scale=1.0, v_scale=1.0, causal=True)
    return batch, importlib.import_module("kvlab.kernels.grid").plan_launch(batch, num_sms=num_sms)


def _grid_question() -> dict[str, Any]:
    grid = importlib.import_module("kvlab.kernels.grid")
    num_seqs, context, num_sms = 64, 8192, 132
    batch, plan = _decode_plan(num_seqs, context, num_sms)
    kv_bytes = 2 * context * 8 * 128 * 2                           # K and V of one sequence, all KV heads, bf16
    return {"grid": plan.grid, "num_seqs": num_seqs, "num_sms": num_sms, "waves": grid.TARGET_WAVES,
            "working_programs": num_seqs * 8 * plan.num_kv_splits,
            "heads_per_program": batch.num_queries_per_kv, "block_q": plan.config.block_q,
            "kv_bytes_per_seq": kv_bytes, "unpacked_kv_bytes_per_seq": kv_bytes * batch.num_queries_per_kv}


ask(
    "05.q1",
    ("Llama-3-8B heads (32 query, 8 KV, head 128, bf16), a decode batch of 64 sequences of 8K tokens on an "
     "H200 (132 SMs): what grid does paged_attention launch, how many programs do work, and how much KV "
     "does one sequence make the GPU read, with GQA packing and without it?"),
    _grid_question,
    lambda v: (
        f"Grid {v['grid']}: axis 0 is an upper bound on query blocks of {v['block_q']} tokens (num_tokens // "
        f"BLOCK_Q + num_seqs = {v['num_seqs']} // {v['block_q']} + {v['num_seqs']}), so only "
        f"{v['working_programs']} programs work, one per sequence and KV head; the rest find no query block and "
        f"exit at once. No split: {v['working_programs']} programs already fill {v['waves']} waves of "
        f"{v['num_sms']} SMs. Each program serves the {v['heads_per_program']} query heads of its KV head, so a "
        f"sequence's KV is read once, {format_bytes(v['kv_bytes_per_seq'])}; one program per query head would read "
        f"{format_bytes(v['unpacked_kv_bytes_per_seq'])}."),
)


def _layout_question() -> dict[str, Any]:
    layouts = importlib.import_module("kvlab.kernels.layouts")
    x = layouts.legacy_x(torch.bfloat16)
    cache = torch.empty(1000, 16, 8, 128, dtype=torch.bfloat16, device="meta")   # [blocks, block_size, Hkv, D]
    k5, v4 = layouts.to_legacy_layout(cache, cache)
    return {"x": x, "k_shape": tuple(k5.shape), "v_shape": tuple(v4.shape),
            "x_fp8": layouts.legacy_x(torch.float8_e4m3fn)}


ask(
    "05.q2",
    ("One layer of a bf16 cache with 1,000 blocks of 16 tokens, 8 KV heads, head size 128: what shapes do "
     "K and V take in vLLM's older CUDA layout, and why is only K cut into pieces of x?"),
    _layout_question,
    lambda v: (
        f"x = 16 bytes / 2 = {v['x']} (FP8: {v['x_fp8']}). K is {list(v['k_shape'])}, V is {list(v['v_shape'])}. "
        "q . k sums over the head dimension, so a thread loads x consecutive dimensions of one key in a single "
        "16-byte load, and the threads working on neighbouring keys find their vectors side by side. p . v sums "
        "over tokens, so V keeps a block's tokens innermost. The layout follows the reduction."),
)


def _fp8_question() -> dict[str, Any]:
    fp8 = importlib.import_module("kvlab.kernels.fp8")
    small, large = torch.tensor([0.001]), torch.tensor([1000.0])
    return {"small_stored": float(fp8.quantize_fp8(small, 1.0).float()),
            "large_stored": float(fp8.quantize_fp8(large, 1.0).float()),
            "small_calibrated": float(fp8.dequantize_fp8(fp8.quantize_fp8(small, 0.001 / 200), 0.001 / 200)),
            "max": fp8.E4M3_MAX}


ask(
    "05.q3",
    ("An FP8 (e4m3) cache with vLLM's default scale 1.0 receives a value of 0.001 and one of 1000. What does "
     "it store, and what does a calibrated scale (amax / 200) change?"),
    _fp8_question,
    lambda v: (
        f"0.001 lies below e4m3's smallest normal (2^-6), where steps are 2^-9 apart: it is stored as "
        f"{v['small_stored']:.6g}, almost twice too large. 1000 is past the largest e4m3 value and saturates to "
        f"{v['large_stored']:g}. A scale of amax / 200 maps the tensor's largest value to 200, so 0.001 in a "
        f"tensor of amax 0.001 comes back as {v['small_calibrated']:.6g}: every value keeps its 3 mantissa "
        "bits."),
)


def _split_question() -> dict[str, Any]:
    grid = importlib.import_module("kvlab.kernels.grid")
    num_seqs, context, num_sms = 4, 2048, 132
    _, plan = _decode_plan(num_seqs, context, num_sms)
    tiles = context // plan.config.tile_n
    return {"grid": plan.grid, "splits": plan.num_kv_splits, "programs_unsplit": num_seqs * 8,
            "target": grid.TARGET_WAVES * num_sms, "waves": grid.TARGET_WAVES, "num_sms": num_sms,
            "min_tiles": grid.MIN_TILES_PER_SPLIT, "tiles": tiles, "tiles_per_split": tiles // plan.num_kv_splits}


ask(
    "05.q4",
    ("The same heads as question 1 (32 query, 8 KV, head 128) but a small decode batch: 4 sequences of 2,048 tokens "
     "on the same H200. Does paged_attention split each sequence's keys, into how many parts, and why?"),
    _split_question,
    lambda v: (
        f"Yes, into {v['splits']}: grid {v['grid']}. Unsplit, the batch makes only {v['programs_unsplit']} working "
        f"programs (4 sequences x 8 KV heads) for {v['target']} program slots ({v['waves']} waves of {v['num_sms']} "
        f"SMs), so most SMs would idle. Splitting cuts each sequence's {v['tiles']} key tiles into ranges of "
        f"{v['tiles_per_split']} (no fewer than {v['min_tiles']} per split, a power of two), and a second kernel "
        "merges the partial softmaxes. The 64-sequence batch of question 1 fills the GPU unsplit."
    ),
    transfer=True,
)
