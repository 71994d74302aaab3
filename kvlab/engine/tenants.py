"""What one tenant of a shared engine learns of another's prompt from ``vllm:prefix_cache_hits``; how a salt stops it.

Every request of one engine shares one prefix cache, and the counter ``vllm:prefix_cache_hits``
grows by the tokens each admitted request found cached. A tenant who sends a prompt of its own
and reads the counter before and after learns whether those blocks were cached, that is,
whether somebody sent them. Hits are whole blocks and cover at most ``num_tokens - 1`` tokens,
so the probe ``known + [guess, filler]``, with ``known + [guess]`` ending on a block boundary,
hits one block more exactly when ``guess`` is the token another tenant's prompt has there:
knowing the rest of a block, the prober confirms its last token, and block by block a guess of a
whole prompt. vLLM's ``cache_salt`` enters the first block's hash (and through the chain every
later one), so requests with different salts never share a block: the counter then says
nothing about anybody else. vLLM asks for a salt that is random, secret and long (256 bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.errors import KvlabValueError


def probe_hits(engine: Any, prompt: Sequence[int], cache_salt: str | None = None) -> int:
    """Tokens of ``prompt`` found in the prefix cache: ``vllm:prefix_cache_hits`` before and after one request."""
    before = engine.metrics.value("vllm:prefix_cache_hits")
    engine.generate([prompt], max_tokens=1, cache_salt=cache_salt, use_tqdm=False)
    return int(engine.metrics.value("vllm:prefix_cache_hits") - before)


def guess_token(engine: Any, known: Sequence[int], candidates: Sequence[int], cache_salt: str | None = None
                ) -> tuple[int | None, dict[int, int]]:
    """Which of ``candidates`` follows ``known`` in a prompt someone cached; each candidate's probe hits.

    ``len(known) + 1`` must be a multiple of the engine's block size, so the guessed token ends a
    block. Returns the one candidate whose probe hit more than all the others (None if none
    stands out: then the counter told nothing) and the hits of every probe.
    """
    known, block_size = list(known), engine.block_size
    if (len(known) + 1) % block_size:
        raise KvlabValueError(
            f"known has {len(known)} tokens; the guessed token must end a block, so len(known) + 1 must be a "
            f"multiple of the block size {block_size}"
        )
    if len(set(candidates)) < 2:
        raise KvlabValueError(f"candidates must hold at least two different token ids, got {list(candidates)}")
    filler = candidates[0]  # any token: it only makes the guessed one count among the tokens that may hit
    hits = {c: probe_hits(engine, [*known, c, filler], cache_salt) for c in dict.fromkeys(candidates)}
    best = max(hits.values())
    winners = [c for c, h in hits.items() if h == best]
    return (winners[0] if len(winners) == 1 else None), hits
