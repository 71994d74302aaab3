"""Seeded random traffic for the twin, and a shrinker that cuts a diverging trace down to a short reproducer."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from twin import Divergence, Twin


@dataclass(frozen=True)
class Config:
    """One random trace's pool and hashing; ``str(config)`` names it in a failure."""

    num_blocks: int
    block_size: int
    hash_fn: str = "sha256"
    enable_caching: bool = True
    hash_block_size: int | None = None
    seed: str | None = None
    watermark: float = 0.0
    groups: tuple = ("full",)  # a hybrid model's KV cache groups: "full" or a sliding window's size each

    def twin(self) -> Twin:
        return Twin(self.num_blocks, self.block_size, self.enable_caching, self.hash_fn, self.hash_block_size,
                    self.seed, watermark=self.watermark, groups=self.groups)


def generate(config: Config, rng: random.Random, num_ops: int, twin: Twin | None = None) -> tuple[list[tuple], Twin]:
    """Draw ``num_ops`` operations, each chosen from the twin's current state, running them as they are drawn.

    Requests share a few prefixes (so they hit), sometimes carry a salt, a LoRA adapter or an
    image, are admitted in chunks with lookahead or external tokens, decode, are preempted
    and finish; some are too large for the pool and must be refused by both sides.
    """
    twin = twin or config.twin()
    bs = config.block_size
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([bs, 2 * bs, 3 * bs + 1, 2 * bs - 1]))]
                for _ in range(3)]
    ops: list[tuple] = []
    count = 0
    history: list[list[int]] = []  # earlier prompts: a follow-up turn extends one (multi-turn chat)
    for _ in range(num_ops):
        waiting = [rid for rid, p in twin.pairs.items() if p.state == "waiting"]
        running = [rid for rid, p in twin.pairs.items() if p.state == "running"]
        roll = rng.random()
        if roll < 0.18 and len(waiting) < 6 or not (waiting or running):
            count += 1
            op = _arrival(rng, f"r{count}", prefixes, bs, config.num_blocks, history)
            history = (history + [op[2]])[-8:]
        elif roll < 0.45 and waiting:
            op = ("admit", rng.choice(waiting), rng.choice([1, bs, 3 * bs, 1000]),
                  rng.choice([0, 0, 0, 1, bs]), rng.choice([0, 0, 0, 0, bs, 2 * bs]),
                  rng.random() < 0.1, rng.choice([0, 0, 0, 1]), rng.random() < 0.05,
                  rng.choice([None, None, None, None, bs, 3 * bs]))
        elif roll < 0.85 and running:
            op = ("run", rng.choice(running), rng.choice([1, 1, bs, 2 * bs]), rng.choice([0, 0, 0, 2, bs]),
                  rng.randrange(50))
        elif roll < 0.92 and running:
            op = ("finish", rng.choice(running))
        elif roll < 0.985 and running:
            op = ("preempt", rng.choice(running))
        elif roll < 0.99 and waiting:
            op = ("finish", rng.choice(waiting))  # aborted while waiting
        elif roll < 0.995:
            op = ("reset",)
        else:
            op = ("drain",)  # every request finishes, then the prefix cache is reset
        ops.append(op)
        twin.apply(op)
        if op[0] == "finish":
            twin.pairs.pop(op[1], None)  # keep the per-operation comparison small
    return ops, twin


def _arrival(rng: random.Random, rid: str, prefixes: list[list[int]], bs: int, num_blocks: int,
             history: list[list[int]]) -> tuple:
    prefix = rng.choice(prefixes + [[]] + (history if rng.random() < 0.5 else []))
    cut = len(prefix) if rng.random() < 0.7 else rng.randrange(len(prefix) + 1)
    tail_len = rng.choice([1, 3, bs - 1, bs, 2 * bs + 3]) if rng.random() < 0.95 else num_blocks * bs + 5
    tokens = prefix[:cut] + [rng.randrange(50) for _ in range(tail_len)]
    if history and rng.random() < 0.15:
        tokens = list(rng.choice(history))  # the same prompt again: a fully cached prompt recomputes its end
    salt = rng.choice([None] * 6 + ["tenant-a", "tenant-b"])
    lora = rng.choice([None] * 6 + ["sql", "math"])
    mm = ()
    if rng.random() < 0.08 and len(tokens) > 6:
        offset = rng.randrange(len(tokens) - 4)
        mm = ((rng.choice(["cat", "dog"]), offset, rng.randrange(1, min(len(tokens) - offset, 2 * bs) + 1)),)
    return ("add", rid, tokens, salt, lora, None, mm)


def replay(config: Config, ops: list[tuple]) -> Divergence | None:
    """Run ``ops`` on a fresh twin; the divergence they cause, or None."""
    twin = config.twin()
    try:
        for op in ops:
            twin.apply(op)
            if op[0] == "finish":
                twin.pairs.pop(op[1], None)
    except Divergence as exc:
        return exc
    return None


def shrink(config: Config, ops: list[tuple], budget: int = 400) -> list[tuple]:
    """A shorter list of operations that still diverges (greedy delta debugging, at most ``budget`` replays)."""
    return shrink_ops(lambda candidate: replay(config, candidate) is not None, ops, budget)


def shrink_ops(fails: Callable[[list[tuple]], bool], ops: list[tuple], budget: int = 400) -> list[tuple]:
    """Greedy delta debugging: drop ever smaller runs of ``ops`` while ``fails`` still holds (``budget`` tries)."""
    chunk = max(len(ops) // 2, 1)
    while chunk >= 1 and budget > 0:
        i = 0
        while i < len(ops) and budget > 0:
            candidate = ops[:i] + ops[i + chunk:]
            budget -= 1
            if candidate and fails(candidate):
                ops = candidate
            else:
                i += chunk
        chunk //= 2
    return ops


def run_trace(config: Config, seed: int, num_ops: int) -> int:
    """Run one seeded trace; on a divergence, fail with a shrunk reproducer. Returns the operations compared."""
    rng = random.Random(seed)
    twin = config.twin()
    ops: list[tuple] = []
    try:
        more, twin = generate(config, rng, num_ops, twin)
        ops += more
    except Divergence as exc:
        ops = _ops_until_failure(config, seed, num_ops)
        small = shrink(config, ops)
        lines = "\n".join(f"    {op!r}," for op in small)
        raise Divergence(f"{config} seed={seed}: {exc}\nreproducer ({len(small)} of {len(ops)} operations):\n"
                         f"[\n{lines}\n]") from None
    return twin.ops


def _ops_until_failure(config: Config, seed: int, num_ops: int) -> list[tuple]:
    """Draw the same trace again, recording each operation before it runs, up to the one that diverges."""
    rng = random.Random(seed)
    recorded: list[tuple] = []
    twin = config.twin()
    original = twin.apply

    def recording(op: tuple) -> None:
        recorded.append(op)
        original(op)

    twin.apply = recording  # type: ignore[method-assign]
    with contextlib.suppress(Divergence):
        generate(config, rng, num_ops, twin)
    return recorded
