"""Notebook 03's pictures: the physical block pool, each block table, the free queue, and a step-through panel.

``figure_pool`` draws one ``PoolSnapshot`` (from ``kvlab.sim.block_scenarios``), laid out in
pixels for a projector (``kvlab.viz.canvas``):

* the **physical blocks** in one row, each coloured by its state (free, cached-but-free with its
  hash prefix, held by one sequence in that sequence's colour, shared with its ref count, the
  null block dashed). With small blocks (up to ``SLOTS_UP_TO`` tokens) every slot shows its
  token, as a word ("Four score and seven ...", the PagedAttention paper's example) or as its
  integer id (``tokens="ids"``); larger blocks show how full they are, their tokens on hover;
* a copy-on-write copy as a red arc from the shared block to its copy;
* the **block tables** on a shelf below the pool (a second one above it when they do not fit),
  each entry with an arrow up to its physical block. The arrows run in the gap between shelf
  and pool, never through a cell; each table is named under its entries;
* the **free queue** from head (allocated next) to tail.

``kvlab.viz.step_panels.BlockPoolPanel`` steps through a scenario with these pictures.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence

import plotly.graph_objects as go

from kvlab.core.kv_cache_utils import short_hash
from kvlab.sim.block_scenarios import BlockView, PoolSnapshot, Scenario, Step, record
from kvlab.viz.canvas import INK, MUTED, Canvas, text_width, tint, wrap
from kvlab.viz.words import TOKEN_MODES, token_label, token_text

#: Sequence colours (Okabe-Ito, told apart by colour-blind readers too).
SEQUENCE_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#D55E00", "#0072B2")
STATE_COLOURS = {"free": "#F3F4F6", "cached": "#FFF7CC", "shared": "#334155", "held": "#94A3B8", "null": "#FFFFFF"}
COPY_COLOUR = "#B42318"
WIDTH = 820  # fits a notebook output area at 1280x720 with the file browser open
PAD = 10
LABEL_W = 86  # the left column that names each part
X0 = PAD + LABEL_W  # where blocks start
AVAILABLE = WIDTH - PAD - X0
SLOTS_UP_TO = 8  # blocks of up to this many tokens draw one slot per token
SLOT_H = 15
HEADER_H = 30  # a slotted block's id and state, above its slots
COMPACT_H = 46
TABLE_W, TABLE_H, TABLE_PITCH = 36, 30, 40
ARROW_GAP = 46  # between a shelf of tables and the pool: the arrows' room
COPY_ZONE = 30  # above the pool: the copy-on-write arcs' room
GROUP_GAP = 22
LABEL_H = 18


def assign_colours(steps: list[Step]) -> dict[str, str]:
    """A colour per sequence over a whole scenario: each new one takes the first colour no live one uses."""
    colours: dict[str, str] = {}
    for step in steps:
        for name in step.snapshot.tables:
            if name not in colours:
                taken = {colours[n] for n in step.snapshot.tables if n in colours}
                free = [c for c in SEQUENCE_COLOURS if c not in taken] or list(SEQUENCE_COLOURS)
                colours[name] = free[0]
    return colours


def _cell_style(view: BlockView, colours: dict[str, str]) -> tuple[str, str, str, str]:
    """Fill, border and text colour, and the state line (``null``, ``#hash``, ``free``, ``ref n``) of a block."""
    if view.state == "null":
        return STATE_COLOURS["null"], "#6B7280", "#6B7280", "null"
    if view.state == "cached":
        return STATE_COLOURS["cached"], "#D97706", "#78350F", "#" + short_hash(view.block_hash)[:4]
    if view.state == "free":
        return STATE_COLOURS["free"], "#9CA3AF", "#4B5563", "free"
    if view.ref_cnt == 1 and len(view.holders) == 1:
        return colours[view.holders[0]], "#374151", INK, "ref 1"
    fill = STATE_COLOURS["shared"] if view.holders else STATE_COLOURS["held"]
    return fill, INK, "#FFFFFF", f"ref {view.ref_cnt}"


def _count(tokens: int) -> str:
    return f"{tokens} token" if tokens == 1 else f"{tokens} tokens"


def _hover(view: BlockView, block_size: int, tokens: str) -> str:
    parts = [f"block {view.block_id}: {view.state}", f"ref_cnt {view.ref_cnt}"]
    if view.holders:
        parts.append("in the tables of " + ", ".join(view.holders))
    if view.state in ("in use", "cached"):
        parts.append(f"{view.num_tokens} of {block_size} slots written")
    if view.token_ids:
        parts.append("holds: " + html.escape(token_text(view.token_ids, tokens)))
    if view.block_hash is not None:
        parts.append("hash " + short_hash(view.block_hash))
    return "<br>".join(parts)


# --------------------------------------------------------------------------- geometry


@dataclasses.dataclass(frozen=True)
class _PoolGeometry:
    """Where each physical block is drawn: ``cols`` to a row, ``pitch`` apart, from ``top``."""

    top: float
    num_blocks: int
    slots: bool
    block_size: int
    pitch: float
    cols: int

    @property
    def cell_w(self) -> float:
        return self.pitch - 4

    @property
    def cell_h(self) -> float:
        return HEADER_H + SLOT_H * self.block_size + 3 if self.slots else COMPACT_H

    @property
    def bottom(self) -> float:
        return self.top + math.ceil(self.num_blocks / self.cols) * (self.cell_h + 8) - 8

    def box(self, block_id: int) -> tuple[float, float, float, float]:
        x = X0 + (block_id % self.cols) * self.pitch
        y = self.top + (block_id // self.cols) * (self.cell_h + 8)
        return x, y, x + self.cell_w, y + self.cell_h


def _pool_geometry(snap: PoolSnapshot, top: float) -> _PoolGeometry:
    slots = snap.block_size <= SLOTS_UP_TO
    widest, narrowest = (60, 48) if slots else (48, 42)
    n = max(len(snap.blocks), 1)
    pitch = min(widest, AVAILABLE / n)
    if pitch < narrowest:  # does not fit one row: wrap at the narrowest pitch
        pitch = narrowest
    return _PoolGeometry(top, len(snap.blocks), slots, snap.block_size, pitch, max(int(AVAILABLE // pitch), 1))


@dataclasses.dataclass(frozen=True)
class _Group:
    """One block table on a shelf: its name, the entries drawn, and how many were left out."""

    name: str
    label: str
    entries: tuple[int, ...]
    hidden: int

    @property
    def width(self) -> float:
        cells = len(self.entries) + (1 if self.hidden else 0)
        return max(cells * TABLE_PITCH - 4, text_width(self.label, 13) + 16)


def _groups(snap: PoolSnapshot) -> list[_Group]:
    room = int((AVAILABLE + 4) // TABLE_PITCH)
    found = []
    for name, table in snap.tables.items():
        label = f"{name} · {_count(snap.num_tokens[name])}"
        shown = table if len(table) <= room else table[: room - 1]
        found.append(_Group(name, label, tuple(shown), len(table) - len(shown)))
    return found


def _by_pool_position(groups: list[_Group]) -> list[_Group]:
    """The tables in the order of the blocks they alone hold, so that their own arrows run up without crossing;
    a table that holds no block of its own keeps its place among those before it (a stable sort)."""
    holders: dict[int, int] = {}
    for group in groups:
        for block_id in set(group.entries):
            holders[block_id] = holders.get(block_id, 0) + 1
    keys, last = [], -1.0
    for group in groups:
        own = [b for b in group.entries if holders[b] == 1]
        last = min(own) if own else last
        keys.append(last)
    return [g for _, g in sorted(zip(keys, groups, strict=True), key=lambda pair: pair[0])]


def _shelves(groups: list[_Group]) -> list[list[_Group]]:
    """Tables packed left to right onto shelves of the drawing's width, in the pool's order."""
    groups = _by_pool_position(groups)
    shelves: list[list[_Group]] = [[]]
    used = 0.0
    for group in groups:
        if shelves[-1] and used + GROUP_GAP + group.width > AVAILABLE:
            shelves.append([])
            used = 0.0
        used += (GROUP_GAP if shelves[-1] else 0) + group.width
        shelves[-1].append(group)
    return shelves


def shelves_needed(snap: PoolSnapshot) -> int:
    """How many shelves (1 or 2) the block tables of ``snap`` take."""
    return min(len(_shelves(_groups(snap))), 2)


# --------------------------------------------------------------------------- drawing


def _heading(canvas: Canvas, title: str, caption: str) -> float:
    y = PAD
    if title:
        y = canvas.lines(PAD, y, wrap(title, WIDTH - 2 * PAD, 15), 15, INK, bold_first=True)
    if caption:
        y = canvas.lines(PAD, y + 2, wrap(caption, WIDTH - 2 * PAD, 13), 13, "#1F2937")
    return y + 6


def _legend(canvas: Canvas, y: float, slots: bool, colours: dict[str, str], copies: bool = True) -> float:
    """The key, its entries wrapped into as many rows as the width needs; returns the y below it."""
    first = next(iter(colours.values()), SEQUENCE_COLOURS[0])
    entries = [
        (STATE_COLOURS["free"], "#9CA3AF", "free"),
        (STATE_COLOURS["cached"], "#D97706", "cached and free: #hash, * in the queue"),
        (STATE_COLOURS["shared"], INK, "shared: ref_cnt > 1"),
        (first, "#374151", "held by one sequence, in its colour"),
    ]
    if copies:
        entries.append(("copy", COPY_COLOUR, "copy-on-write copy"))
    if not slots:
        entries.append((INK, INK, "▬ slots written"))
    x = PAD
    for fill, line, label in entries:
        width = 18 + text_width(label, 12) + 18
        if x + width > WIDTH - PAD:
            x, y = PAD, y + LABEL_H
        if fill == "copy":
            canvas.arc((x, y + 12), (x + 13, y + 12), 4, line, width=2)
        elif label.startswith("▬"):
            label = label[2:]
            canvas.rect(x, y + 7, x + 13, y + 10, fill, line, width=0)
        else:
            canvas.rect(x, y + 3, x + 13, y + 16, fill, line, width=1.5)
        canvas.text(x + 18, y + 10, html.escape(label), 12, "#374151", anchor="left")
        x += width
    return y + LABEL_H + 6


def _side_label(canvas: Canvas, y_mid: float, words: tuple[str, str], note: str = "") -> None:
    text = f"<b>{words[0]}</b><br><b>{words[1]}</b>" + (f"<br><span style='font-size:11px'>{note}</span>"
                                                          if note else "")
    canvas.text(PAD, y_mid, text, 13, INK, anchor="left")


def _draw_pool(canvas: Canvas, snap: PoolSnapshot, pool: _PoolGeometry, colours: dict[str, str],
               tokens: str) -> None:
    """Every physical block, with its id, its state and (slotted) its tokens."""
    _side_label(canvas, (pool.top + pool.bottom) / 2, ("physical", "blocks"), "by block id")
    max_chars = max(int((pool.cell_w - 6) / (11 * 0.58)), 3)
    for view in snap.blocks:
        x0, y0, x1, y1 = pool.box(view.block_id)
        fill, line, ink, state = _cell_style(view, colours)
        dash, width = ("dot", 1.5) if view.is_null else ("solid", 2.5 if view.state == "cached" else 1.5)
        mid = (x0 + x1) / 2
        if pool.slots:
            canvas.rect(x0, y0, x1, y0 + HEADER_H, fill, line, width, dash)
            canvas.rect(x0, y0 + HEADER_H, x1, y1, "#FFFFFF", line, width, dash)
            canvas.text(mid, y0 + 10, str(view.block_id), 13, ink, bold=True)
            canvas.text(mid, y0 + 23, state, 11, ink)
            stale = view.state == "free"  # what a freed, unhashed block held: nobody will read it again
            written = tint(fill if fill not in ("#FFFFFF", STATE_COLOURS["shared"]) else "#94A3B8", 0.6)
            for slot, token in enumerate(view.token_ids):
                top = y0 + HEADER_H + slot * SLOT_H
                if not stale:
                    canvas.rect(x0 + 2, top + 1, x1 - 2, top + SLOT_H, written, written, width=0)
                canvas.text(mid, top + SLOT_H / 2 + 1, html.escape(token_label(token, tokens, max_chars)), 11,
                            "#9CA3AF" if stale else INK)
        else:
            canvas.rect(x0, y0, x1, y1, fill, line, width, dash)
            canvas.text(mid, y0 + 15, str(view.block_id), 15, ink, bold=True)
            canvas.text(mid, y0 + 31, state, 11, ink)
            if view.state in ("in use", "cached") and view.num_tokens:
                share = min(view.num_tokens / snap.block_size, 1.0)
                bar = "#F9FAFB" if ink == "#FFFFFF" else INK
                canvas.rect(x0 + 4, y1 - 7, x0 + 4 + (pool.cell_w - 8) * share, y1 - 4, bar, bar, width=0)
        canvas.point("pool", mid, (y0 + y1) / 2, _hover(view, snap.block_size, tokens))


def _draw_copies(canvas: Canvas, pool: _PoolGeometry, copies: Sequence[tuple[int, int]]) -> None:
    """Each copy-on-write copy as a red arc from the shared block over to its copy, labelled."""
    for src, dst in copies:
        (sx0, sy0, sx1, _), (dx0, dy0, dx1, _) = pool.box(src), pool.box(dst)
        apex = canvas.arc(((sx0 + sx1) / 2, sy0), ((dx0 + dx1) / 2, dy0), 9, COPY_COLOUR)
        canvas.text(apex[0], apex[1] - 3, f"copy {src} → {dst}", 11, COPY_COLOUR, valign="bottom", bold=True)


def _bundles(shelf: list[_Group]) -> dict[int, int]:
    """Blocks held by two or more entries of this shelf, each with its bus level (0 nearest the tables)."""
    count: dict[int, int] = {}
    for group in shelf:
        for block_id in group.entries:
            count[block_id] = count.get(block_id, 0) + 1
    shared = sorted(b for b, n in count.items() if n > 1)
    return {b: level for level, b in enumerate(shared)}


BUS_PITCH = 10  # px between the buses of two shared blocks
JOINT_R = 3.2  # a dot where a stub joins its bus (no dot: the lines only cross)


def _draw_shelf(canvas: Canvas, snap: PoolSnapshot, shelf: list[_Group], pool: _PoolGeometry, top: float,
                below: bool, colours: dict[str, str]) -> float:
    """One shelf of block tables at ``top``, arrows to the pool above (``below``) or under it; returns its bottom.

    An entry whose block no other table of the shelf holds gets its own arrow. The entries of a shared
    block are bundled: a short stub from each, in its table's colour, meets a bus, and one arrow runs
    from the bus to the block, so a fork's tables do not cross a dozen arrows on their way up.
    """
    cells_top = top if below else top + LABEL_H
    cells_bottom = cells_top + TABLE_H
    _side_label(canvas, (cells_top + cells_bottom) / 2, ("block", "tables"))
    bundles = _bundles(shelf)
    edge = cells_top if below else cells_bottom  # where arrows leave the tables
    toward = -1 if below else 1  # the pool's direction, in y
    stubs: dict[int, list[float]] = {b: [] for b in bundles}
    x = X0
    for group in shelf:
        colour = colours[group.name]
        for logical, block_id in enumerate(group.entries):
            cx = x + logical * TABLE_PITCH
            canvas.rect(cx, cells_top, cx + TABLE_W, cells_bottom, colour, "#374151")
            canvas.text(cx + TABLE_W / 2, (cells_top + cells_bottom) / 2, str(block_id), 14, INK, bold=True)
            bx0, by0, bx1, by1 = pool.box(block_id)
            if block_id in bundles:
                bus_y = edge + toward * (10 + BUS_PITCH * bundles[block_id])
                canvas.line((cx + TABLE_W / 2, edge), (cx + TABLE_W / 2, bus_y), colour, 2.2)
                canvas.dot((cx + TABLE_W / 2, bus_y), JOINT_R, INK)
                stubs[block_id].append(cx + TABLE_W / 2)
            else:
                canvas.arrow((cx + TABLE_W / 2, edge), ((bx0 + bx1) / 2, by1 if below else by0), colour)
            first = logical * snap.block_size
            last = min(first + snap.block_size, snap.num_tokens[group.name]) - 1
            canvas.point("tables", cx + TABLE_W / 2, (cells_top + cells_bottom) / 2,
                         f"{group.name}: logical block {logical} → physical block {block_id}<br>tokens {first}–{last}")
        if group.hidden:
            hx = x + len(group.entries) * TABLE_PITCH
            canvas.text(hx + TABLE_W / 2, (cells_top + cells_bottom) / 2, f"+{group.hidden}", 13, MUTED)
        label_y = cells_bottom + 4 if below else top
        swatch = f"<span style='color:{colour}'>■</span> "
        canvas.text(x, label_y, swatch + f"<b>{html.escape(group.name)}</b>" + html.escape(group.label[len(
            group.name):]), 13, INK, anchor="left", valign="top")
        x += group.width + GROUP_GAP
    for block_id, xs in stubs.items():  # each shared block: a bus under its entries, one arrow to the block
        bx0, by0, bx1, by1 = pool.box(block_id)
        bus_y, mid = edge + toward * (10 + BUS_PITCH * bundles[block_id]), (bx0 + bx1) / 2
        canvas.line((min(*xs, mid), bus_y), (max(*xs, mid), bus_y), INK, 2.2)
        canvas.dot((mid, bus_y), JOINT_R, INK)
        canvas.arrow((mid, bus_y), (mid, by1 if below else by0), INK)
    return cells_bottom + LABEL_H + 4 if below else cells_bottom


def draw_free_queue(canvas: Canvas, blocks: Sequence[BlockView], free_queue: Sequence[int], block_size: int,
                    top: float, colours: dict[str, str] | None = None) -> float:
    """The free queue head to tail at ``top``, cached blocks marked *; returns the y below it.

    Shared with notebook 04's ``figure_free_queue``, which draws a manager's real pool.
    """
    colours = colours or {}
    count = len(free_queue)
    cols = int((AVAILABLE + 4) // TABLE_PITCH)
    rows = max(1, math.ceil(count / cols))
    _side_label(canvas, top + (rows * (TABLE_H + LABEL_H)) / 2 - 4, ("free", "queue"), f"{count} free")
    if not count:
        canvas.text(X0, top + TABLE_H / 2, "empty: the next allocation is refused", 13, MUTED, anchor="left")
    for pos, block_id in enumerate(free_queue):
        view = blocks[block_id]
        x = X0 + (pos % cols) * TABLE_PITCH
        y = top + (pos // cols) * (TABLE_H + LABEL_H)
        fill, line, ink, _ = _cell_style(view, colours)
        canvas.rect(x, y, x + TABLE_W, y + TABLE_H, fill, line, 2.5 if view.state == "cached" else 1.5)
        mark = "*" if view.block_hash is not None else ""
        canvas.text(x + TABLE_W / 2, y + TABLE_H / 2, f"{block_id}{mark}", 14, ink, bold=True)
        canvas.point("queue", x + TABLE_W / 2, y + TABLE_H / 2,
                     f"queue position {pos}: " + _hover(view, block_size, "ids"))
        if pos == 0 or pos == count - 1:
            word = "head = tail" if count == 1 else ("head" if pos == 0 else "tail")
            canvas.text(x, y + TABLE_H + 3, word, 11, "#374151", anchor="left", valign="top")
    return top + rows * (TABLE_H + LABEL_H)


def _draw_state(canvas: Canvas, snap: PoolSnapshot, y: float, colours: dict[str, str],
                copies: Sequence[tuple[int, int]], tokens: str, shelves: int | None, free_queue: bool = True) -> float:
    """The pool, its block tables and (``free_queue``) the free queue from ``y`` down; returns the y below."""
    packed = _shelves(_groups(snap))
    upper = packed[1] if len(packed) > 1 else []
    upper_room = (LABEL_H + TABLE_H) + ARROW_GAP
    if upper:
        y += upper_room  # the upper shelf is drawn once the pool is placed
    pool = _pool_geometry(snap, y + COPY_ZONE)
    if upper:
        _draw_shelf(canvas, snap, upper, pool, y - ARROW_GAP - LABEL_H - TABLE_H, False, colours)
    _draw_pool(canvas, snap, pool, colours, tokens)
    _draw_copies(canvas, pool, copies)
    y = pool.bottom + ARROW_GAP
    if packed[0]:
        y = _draw_shelf(canvas, snap, packed[0], pool, y, True, colours)
    else:
        canvas.text(X0, y + TABLE_H / 2, "no live sequence", 13, MUTED, anchor="left")
        y += TABLE_H + LABEL_H + 4
    if free_queue:
        y = draw_free_queue(canvas, snap.blocks, snap.free_queue, snap.block_size, y + 12, colours)
    if (shelves or 1) > 1 and not upper:
        y += upper_room  # a stepper keeps one height: the unused room goes below the drawing
    return y


def _colours_for(snap: PoolSnapshot, colours: dict[str, str] | None) -> dict[str, str]:
    names = list(snap.tables)
    return {**{n: SEQUENCE_COLOURS[i % len(SEQUENCE_COLOURS)] for i, n in enumerate(names)}, **(colours or {})}


def figure_pool(
    snap: PoolSnapshot, title: str = "", caption: str = "", shelves: int | None = None,
    colours: dict[str, str] | None = None, copies: Sequence[tuple[int, int]] = (), tokens: str = "words",
    copy_key: bool = True,
) -> go.Figure:
    """The pool, the block tables and the free queue of one snapshot, sized to read when projected.

    ``shelves`` reserves room for that many shelves of tables (so a step-through keeps one
    height); ``colours`` fixes each sequence's colour (default: in the order they appear);
    ``copies`` are the step's copy-on-write copies, drawn as arcs; ``tokens`` is "words" or "ids";
    ``copy_key=False`` leaves the arc out of the key (for a story without copy-on-write).
    """
    if tokens not in TOKEN_MODES:
        token_label(0, tokens)  # raises the named error
    colours = _colours_for(snap, colours)
    canvas = Canvas(WIDTH)
    y = _heading(canvas, title, caption)
    y = _legend(canvas, y, _pool_geometry(snap, 0).slots, colours, copy_key)
    y = _draw_state(canvas, snap, y, colours, copies, tokens, shelves)
    return canvas.figure(y + PAD, parts=("pool", "tables", "queue"))


def figure_before_after(scenario: Scenario, before: Step, after: Step, title: str = "",
                        tokens: str = "words") -> go.Figure:
    """Two steps of one scenario, one above the other, each under its own line: what a write changed
    (copy-on-write's copy drawn in the second). The free queue is left out, so that the pair fits one screen."""
    if tokens not in TOKEN_MODES:
        token_label(0, tokens)
    steps = record(scenario)
    colours = assign_colours(steps)
    canvas = Canvas(WIDTH)
    y = _heading(canvas, title or f"{scenario.name} · before and after step {after.index}", "")
    y = _legend(canvas, y, _pool_geometry(after.snapshot, 0).slots, colours, bool(after.copies))
    for word, step in (("before", before), ("after", after)):
        line = f"<b>{word}</b> (step {step.index} of {step.total}): {html.escape(step.text)}"
        lines = wrap(line, WIDTH - 2 * PAD, 13)
        canvas.rect(PAD, y, WIDTH - PAD, y + 1, "#CBD5E1", "#CBD5E1", width=0)
        y += 6
        for k, text in enumerate(lines):  # wrap() keeps the tags whole: the first line opens and closes <b>
            canvas.text(PAD, y + k * 13 * 1.35, text, 13, "#1F2937", anchor="left", valign="top")
        y += len(lines) * 13 * 1.35
        y = _draw_state(canvas, step.snapshot, y, colours, step.copies, tokens, None, free_queue=False) + 8
    return canvas.figure(y + PAD, parts=("pool", "tables"))


def figure_step(scenario: Scenario, step: Step, caption: bool = True, tokens: str = "words") -> go.Figure:
    """The picture of one step, titled with the scenario and the step (and its text, when ``caption``)."""
    steps = record(scenario)
    shelves = max(shelves_needed(s.snapshot) for s in steps)
    return figure_pool(step.snapshot, f"{scenario.name} · step {step.index} of {step.total}",
                       step.text if caption else "", shelves=shelves, colours=assign_colours(steps),
                       copies=step.copies, tokens=tokens, copy_key=any(s.copies for s in steps))
