"""Notebook 01's pictures of what the cache is: prefill against decode, K and V per layer, MLA's latent.

Three schematic figures on ``kvlab.viz.canvas``, each computed from a pure function a test
calls directly:

* ``prefill_decode_steps`` / ``figure_prefill_decode``: per step, which positions' K and V
  are written and which the step's queries read. Prefill writes the whole prompt in one step;
  each decode step writes one token and reads every token before it, again;
* ``figure_kv_factors``: one token's K and V in every layer, as the ``f x L x Hkv x D x b`` of
  the formula, with the model's numbers;
* ``latent_against_mha`` / ``figure_mla_latent``: what one layer stores per token, MLA's one
  latent against the K and V of every head its MHA form would keep.
"""

from __future__ import annotations

import dataclasses
import html

import plotly.graph_objects as go

from kvlab._validate import non_negative_int, positive_int
from kvlab.capacity.models import ModelSpec
from kvlab.capacity.sizing import breakdown, dtype_bytes, kv_bytes_per_token
from kvlab.errors import KvlabValueError
from kvlab.units import format_bytes
from kvlab.viz.canvas import INK, MUTED, Canvas, text_width
from kvlab.viz.words import token_label

WRITE, READ, IDLE, QUERY = "#16A34A", "#93C5FD", "#F3F4F6", "#1D4ED8"
K_COLOUR, V_COLOUR, LATENT_COLOUR = "#2563EB", "#EA580C", "#7C3AED"


# --------------------------------------------------------------------------- prefill against decode


@dataclasses.dataclass(frozen=True)
class CacheStep:
    """One forward pass of one request: the positions whose K and V it writes, and those its queries read."""

    kind: str  # "prefill" or "decode"
    written: range
    read: range  # every position some query of this step attends to (causally: each query its own prefix)
    queries: range  # the positions that are queries in this step

    @property
    def num_read(self) -> int:
        return len(self.read)


def prefill_decode_steps(prompt_len: int, decode_steps: int) -> list[CacheStep]:
    """The steps of one request: one prefill of ``prompt_len`` tokens, then ``decode_steps`` single tokens.

    As vLLM V1 runs them: a step first writes its new tokens' K and V into the cache
    (``reshape_and_cache``), then the attention kernel reads, through the block table, every
    cached token up to each query. So a decode step writes one token and reads all of them.
    """
    prompt_len, decode_steps = positive_int("prompt_len", prompt_len), non_negative_int("decode_steps", decode_steps)
    steps = [CacheStep("prefill", range(prompt_len), range(prompt_len), range(prompt_len))]
    for k in range(decode_steps):
        pos = prompt_len + k
        steps.append(CacheStep("decode", range(pos, pos + 1), range(pos + 1), range(pos, pos + 1)))
    return steps


def figure_prefill_decode(prompt_len: int = 6, decode_steps: int = 3, model: ModelSpec | None = None,
                          kv_dtype: str = "bf16") -> go.Figure:
    """A grid: one row per step, one column per position, coloured written / read / not yet there.

    Tokens are words ("Four score and seven ..."); with ``model``, each row also says how many
    bytes of KV the step writes and reads (one request, one GPU).
    """
    steps = prefill_decode_steps(prompt_len, decode_steps)
    positions = prompt_len + decode_steps
    per_token = kv_bytes_per_token(model, kv_dtype) if model is not None else None
    label_w, pitch = 118, min(62, (560 - 118) / positions)
    right = 10 + label_w + pitch * positions + 8
    width = max(int(right + (170 if per_token else 10)), 640)
    canvas = Canvas(width)
    canvas.text(10, 12, "What each step writes into the cache and reads from it", 15, INK, anchor="left",
                valign="top", bold=True)
    y = _key(canvas, 40, [(WRITE, "K, V written this step"), (READ, "K, V read from the cache"),
                          (IDLE, "not there yet")])
    x0 = 10 + label_w
    for p in range(positions):
        canvas.text(x0 + p * pitch + (pitch - 4) / 2, y + 8, html.escape(token_label(p, "words", 7)), 12, MUTED)
    y += 22
    if per_token:
        canvas.text(right + 4, y - 12, "KV bytes written / read", 12, MUTED, anchor="left")
    for k, step in enumerate(steps):
        name = "prefill" if step.kind == "prefill" else f"decode {k}"
        canvas.text(10, y + 15, name, 13, INK, anchor="left", bold=True)
        for p in range(positions):
            fill = WRITE if p in step.written else (READ if p in step.read else IDLE)
            canvas.rect(x0 + p * pitch, y, x0 + p * pitch + pitch - 4, y + 30, fill, "#FFFFFF", 1)
            if p in step.queries:
                canvas.text(x0 + p * pitch + (pitch - 4) / 2, y + 15, "q", 13, "#FFFFFF", bold=True)
            canvas.point("cells", x0 + p * pitch + pitch / 2, y + 15, f"{name}, position {p}: "
                         + ("written" if p in step.written else "read" if p in step.read else "not computed yet"))
        if per_token:
            canvas.text(right + 4, y + 15, f"{format_bytes(len(step.written) * per_token)} / "
                        f"{format_bytes(step.num_read * per_token)}", 12, INK, anchor="left")
        y += 36
    canvas.text(10, y + 6, "q: this step's queries. Prefill reads its own K and V, each query its prefix; "
                "decode reads every earlier token again.", 12, MUTED, anchor="left", valign="top")
    return canvas.figure(y + 30, parts=("cells",))


def _key(canvas: Canvas, y: float, entries: list[tuple[str, str]], x: float = 10) -> float:
    """A one-row key of coloured squares; returns the y below it."""
    for fill, label in entries:
        canvas.rect(x, y, x + 13, y + 13, fill, "#6B7280", 1)
        canvas.text(x + 18, y + 7, html.escape(label), 12, "#374151", anchor="left")
        x += 18 + text_width(label, 12) + 20
    return y + 24


# --------------------------------------------------------------------------- f x L x Hkv x D x b


def figure_kv_factors(model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1) -> go.Figure:
    """One token's cache in one picture: f tensors (K, V) in each of L layers, Hkv heads of D values of b bytes."""
    f = breakdown(model, kv_dtype, tp)
    total = kv_bytes_per_token(model, kv_dtype, tp)
    width = 820
    canvas = Canvas(width)
    formula = (f"{f['f']} × {f['L']} × {f['Hkv']} × {f['D']} × {f['b']:g} B = {format_bytes(total)} per token")
    what = "K and V" if f["f"] == 2 else "latent"
    canvas.text(10, 12, f"{html.escape(model.name)}: one token's {what}", 15, INK, anchor="left", valign="top",
                bold=True)
    canvas.text(10, 34, html.escape(f"f × L × Hkv × D × b = {formula}"), 13, INK, anchor="left", valign="top")
    # The layer stack, L deep, drawn as a few cards with the count.
    for k in range(4):
        x, y = 14 + 8 * k, 70 + 8 * k
        canvas.rect(x, y, x + 120, y + 150, "#F8FAFC" if k < 3 else "#EEF2FF", "#64748B", 1.2)
    canvas.text(14 + 24 + 60, 70 + 24 + 150 + 14, f"L = {f['L']} layers", 13, INK, bold=True)
    canvas.text(14 + 24 + 60, 70 + 24 + 75, "one layer", 12, MUTED)
    canvas.arrow((14 + 24 + 122, 70 + 24 + 75), (210, 150), "#64748B", 1.5)
    tensors = ("K", "V") if f["f"] == 2 else ("latent",)
    heads = int(f["Hkv"])
    shown = min(heads, 8)
    x0, head_w = 220, min(60, (width - 240 - 20) / (shown + (1 if heads > shown else 0)))
    y = 84
    for name in tensors:
        colour = {"K": K_COLOUR, "V": V_COLOUR}.get(name, LATENT_COLOUR)
        canvas.text(x0, y - 4, f"<b>{name}</b>" + (f" · Hkv = {heads} heads" if name != "latent" else
                                                  " · one per token, shared by every head"), 13, INK,
                    anchor="left", valign="bottom")
        for h in range(shown):
            canvas.rect(x0 + h * head_w, y, x0 + (h + 1) * head_w - 4, y + 36, colour, "#1F2937", 1)
            canvas.text(x0 + h * head_w + (head_w - 4) / 2, y + 18, f"h{h}" if name != "latent" else "c", 12,
                        "#FFFFFF", bold=True)
        if heads > shown:
            canvas.text(x0 + shown * head_w + 4, y + 18, f"… {heads - shown} more", 12, MUTED, anchor="left")
        y += 72
    # One head, zoomed: D values of b bytes.
    part = "one head" if f["f"] == 2 else "the latent"
    canvas.text(x0, y - 4, f"<b>{part}</b> · D = {f['D']} values of b = {f['b']:g} bytes ({kv_dtype})", 13, INK,
                anchor="left", valign="bottom")
    cells = 32
    cell_w = (width - x0 - 20) / cells
    for c in range(cells):
        canvas.rect(x0 + c * cell_w, y, x0 + (c + 1) * cell_w - 1, y + 18, "#DBEAFE" if c % 2 else "#BFDBFE",
                    "#93C5FD", 0.5)
    per = "per head and tensor" if f["f"] == 2 else "per layer"
    canvas.text(x0, y + 24, f"{f['D']} values: {f['D']} × {f['b']:g} B = {format_bytes(f['D'] * f['b'])} {per}",
                12, MUTED, anchor="left", valign="top")
    canvas.point("factors", 80, 150, formula)
    return canvas.figure(max(y + 50, 70 + 24 + 150 + 30), parts=("factors",))


# --------------------------------------------------------------------------- MLA's latent


@dataclasses.dataclass(frozen=True)
class LatentComparison:
    """Per layer and token: the values MLA stores (its latent) and those the MHA form would store."""

    model: str
    kv_lora_rank: int
    rope_dim: int
    mha_heads: int
    mha_head_dim: int

    @property
    def latent_values(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def mha_values(self) -> int:
        return 2 * self.mha_heads * self.mha_head_dim

    @property
    def ratio(self) -> float:
        return self.mha_values / self.latent_values


def latent_against_mha(model: ModelSpec) -> LatentComparison:
    """What one MLA layer stores per token against its MHA form (heads x ``v_head_dim``, K and V)."""
    if model.attention != "mla":
        raise KvlabValueError(f"model must use MLA (a config with kv_lora_rank); {model.name} is {model.attention}")
    mha = model.mha_equivalent()
    return LatentComparison(model.name, model.kv_lora_rank, model.qk_rope_head_dim, mha.num_kv_heads, mha.head_dim)


def figure_mla_latent(model: ModelSpec, kv_dtype: str = "bf16") -> go.Figure:
    """Two grids of squares, each square 64 values: the MHA form's K and V of every head, and MLA's one latent."""
    c = latent_against_mha(model)
    unit = 64
    b = dtype_bytes(kv_dtype)
    width, cols, size = 820, 64, 11.5
    canvas = Canvas(width)
    canvas.text(10, 12, f"{html.escape(model.name)}: what one layer stores per token", 15, INK, anchor="left",
                valign="top", bold=True)
    canvas.text(10, 34, f"each square is {unit} values; {kv_dtype}: {format_bytes(unit * b)} a square", 12, MUTED,
                anchor="left", valign="top")
    y = 62
    mha_squares = c.mha_values // unit
    canvas.text(10, y, f"<b>MHA form</b>: K (blue) and V (orange), {c.mha_heads} heads × {c.mha_head_dim} each = "
                f"{c.mha_values:,} values, {format_bytes(c.mha_values * b)}", 13, INK, anchor="left", valign="top")
    y += 22
    for k in range(mha_squares):
        x, row = 10 + (k % cols) * 12.5, y + (k // cols) * 12.5
        canvas.rect(x, row, x + size, row + size, K_COLOUR if k < mha_squares // 2 else V_COLOUR, "#FFFFFF", 0.5)
    y += ((mha_squares + cols - 1) // cols) * 12.5 + 16
    canvas.text(10, y, f"<b>MLA</b>: one latent of kv_lora_rank {c.kv_lora_rank} + rope {c.rope_dim} = "
                f"{c.latent_values} values, {format_bytes(c.latent_values * b)} "
                f"({c.ratio:.1f}× less)",
                13, INK, anchor="left", valign="top")
    y += 22
    for k in range(-(-c.latent_values // unit)):
        share = min(1.0, (c.latent_values - k * unit) / unit)
        x = 10 + k * 12.5
        canvas.rect(x, y, x + size * share, y + size, LATENT_COLOUR, "#FFFFFF", 0.5)
    canvas.text(10, y + 22, "At attention time the latent is multiplied up into every head's K and V (or the "
                "up-projection is folded into the query and output): computed, never stored.", 12, MUTED,
                anchor="left", valign="top")
    canvas.point("sizes", 40, y, f"MHA form {c.mha_values:,} values; latent {c.latent_values}")
    return canvas.figure(y + 46, parts=("sizes",))
