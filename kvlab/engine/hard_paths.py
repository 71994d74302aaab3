"""Token for token against transformers where kernel bugs live: many tiles, several blocks, split-KV, chunk edges.

Short prompts prove little: a context that fits one key tile never exercises the online
softmax's rescale, and a CPU never splits a decode. ``compare_hard_paths`` serves prompts whose
contexts span many tiles and blocks through a real ``LLMEngine``, with the kernel's tiles made
small (``HARD_PATH_CONFIG``: 16 keys per tile), every decode-only step split across programs, and a
token budget that cuts the long prompt into chunks whose edges fall inside a tile and a block;
then it compares the greedy tokens with transformers' own ``generate``. What the run covered is
measured from the scheduler's outputs, not assumed: ``HardPathRun`` holds both.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from kvlab import kernels
from kvlab.engine.evaluation import hf_greedy, num_agreeing_tokens
from kvlab.engine.toy import random_token_ids
from kvlab.kv_cache_interface import MLAAttentionSpec
from kvlab.units import cdiv

#: The tiny model's tiles on the hard paths: 32 query tokens x 2 heads per program, keys 16 per tile.
HARD_PATH_CONFIG = kernels.KernelConfig(block_q=32, block_m=64, tile_n=16)
#: The same for an MLA model's decode kernel: one query token, up to 16 heads per program, 16 latents per tile.
MLA_HARD_PATH_CONFIG = kernels.KernelConfig(block_q=1, block_m=16, tile_n=16)


@dataclasses.dataclass
class HardPathRun:
    """The tokens of both engines and what the run exercised, as measured step by step."""

    prompt_lens: tuple[int, ...]
    kvlab: list[list[int]]
    transformers: list[list[int]]
    tile_n: int
    block_size: int
    decode_kv_splits: int
    max_context: int                    # the longest context any step attended over
    split_decode_steps: int             # decode-only steps, each run with decode_kv_splits programs per sequence
    chunk_boundaries: list[int]         # positions where a prefill chunk started after earlier chunks
    steps: int
    boundaries_by_prompt: tuple[tuple[int, ...], ...] = ()  # the same positions, prompt by prompt

    @property
    def equal(self) -> bool:
        """Whether every prompt's tokens are identical in both engines."""
        return self.kvlab == self.transformers

    @property
    def agreeing_tokens(self) -> list[int]:
        """Per prompt, how many tokens the two agree on before they first differ."""
        return [num_agreeing_tokens(a, b) for a, b in zip(self.kvlab, self.transformers, strict=True)]

    @property
    def max_tiles(self) -> int:
        """Key tiles the longest context spans."""
        return cdiv(self.max_context, self.tile_n)

    @property
    def max_blocks(self) -> int:
        """KV blocks the longest context spans."""
        return cdiv(self.max_context, self.block_size)

    @property
    def boundaries_inside_a_tile(self) -> list[int]:
        """The chunk boundaries that fall strictly inside a key tile (not on its first key)."""
        return [p for p in self.chunk_boundaries if p % self.tile_n]

    def summary(self) -> dict[str, Any]:
        """The run's coverage and verdict, for a table."""
        return {"prompt lengths": self.prompt_lens, "longest context": self.max_context,
                "key tiles it spans": self.max_tiles, "blocks it spans": self.max_blocks,
                "decode steps split": f"{self.split_decode_steps} x {self.decode_kv_splits} splits",
                "chunk boundaries, by prompt": {f"{n}-token prompt": list(b) for n, b in
                                                zip(self.prompt_lens, self.boundaries_by_prompt, strict=True)},
                "tokens agreeing": self.agreeing_tokens,
                "identical": self.equal}


def compare_hard_paths(model_dir: str | os.PathLike, hf_model: Any, *, prompt_lens: Sequence[int] = (150, 70),
                       max_tokens: int = 4, max_num_batched_tokens: int = 44, decode_kv_splits: int = 2,
                       config: kernels.KernelConfig | None = None, block_size: int = 16,
                       seed: int = 600) -> HardPathRun:
    """Serve ``prompt_lens`` random prompts through kvlab's engine on the hard paths; compare with transformers.

    The default budget of 44 tokens cuts a 150-token prompt at 44, 88 and 132: inside tiles of 16
    and blocks of 16. The engine runs the Triton kernels (``attention_backend="triton"``: on a CPU
    through the interpreter), looked up on ``kvlab.kernels`` at each call, so the comparison also
    judges a kernel swapped in by ``kernels.mutants.using_kernels``.
    ``config`` defaults to ``HARD_PATH_CONFIG``, or ``MLA_HARD_PATH_CONFIG`` for an MLA checkpoint, whose
    decode kernel (``kvlab.kernels.mla_decode``) then reads 16 latents per tile, split in two.
    """
    from kvlab.engine.llm_engine import LLMEngine

    prompts = [random_token_ids(n, seed=seed + i) for i, n in enumerate(prompt_lens)]
    engine = LLMEngine(model_dir, num_gpu_blocks=1 + sum(cdiv(n + max_tokens, block_size) for n in prompt_lens),
                       block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                       attention_backend="triton")
    if config is None:
        mla = any(isinstance(s, MLAAttentionSpec) for s in engine.kv_cache_specs)
        config = MLA_HARD_PATH_CONFIG if mla else HARD_PATH_CONFIG
    engine.model_runner.kernel_config = config
    engine.model_runner.decode_kv_splits = decode_kv_splits
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    split_steps, boundaries, max_context = 0, [], 0
    by_prompt: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        scheduled = engine.last_scheduler_output.scheduled
        split_steps += bool(scheduled) and all(s.num_tokens == 1 for s in scheduled)
        for s in scheduled:
            max_context = max(max_context, s.num_computed_tokens + s.num_tokens)
            prompt_len = len(prompts[ids.index(s.request_id)]) if s.request_id in ids else 0
            if 0 < s.num_computed_tokens < prompt_len:               # a chunk that continues a prefill
                boundaries.append(s.num_computed_tokens)
                by_prompt[ids.index(s.request_id)].append(s.num_computed_tokens)
    reference = [hf_greedy(hf_model, p, max_tokens) for p in prompts]
    return HardPathRun(tuple(prompt_lens), [engine.outputs[i] for i in ids], reference, config.tile_n, block_size,
                       decode_kv_splits, max_context, split_steps, boundaries, len(engine.history),
                       tuple(tuple(b) for b in by_prompt))
