"""Choosing the next token from a row of logits: greedy, or a seeded draw at a temperature.

A draw uses vLLM's trick: ``argmax(probs / q)`` with ``q ~ Exponential(1)`` picks token ``i``
with probability ``probs[i]`` (the "exponential race"), and needs only one generator call
per step. Each request owns its generator, seeded from its ``SamplingParams.seed``, so its
draws do not depend on which other requests share the batch: a request gives the same
tokens alone, in a crowd, or after being preempted and recomputed. The draw runs on the CPU
(one row of probabilities per request), so a seed gives the same tokens on a GPU machine too.

Logits that hold NaN or infinity raise ``NonFiniteLogitsError`` naming the request, greedy or
not: ``argmax`` over NaN would silently pick token 0. vLLM 0.33.0 does not check by default; it
counts NaNs only with ``VLLM_COMPUTE_NANS_IN_LOGITS=1`` (the ``vllm:corrupted_requests`` counter)
and raises, for the whole step, only with ``VLLM_RAISE_ON_LOGIT_NANS=1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvlab.core.sched.output import SamplingParams
from kvlab.errors import NonFiniteLogitsError


class Sampler:
    """Greedy or seeded random sampling, one ``torch.Generator`` per request."""

    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}

    def sample_batch(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[tuple[str, SamplingParams]]
                     ) -> tuple[dict[str, int], dict[str, Exception]]:
        """The next token of each of ``requests`` from its row of ``logits [num_seqs, vocab_size]``, and the
        requests that could not be sampled with why (their exception; the others are sampled all the same).

        One finiteness check and one ``argmax`` serve every greedy request at once (vLLM's sampler also
        takes the whole batch); a draw at a temperature, or a row that is not finite, goes through ``sample``
        request by request (a draw needs the request's own generator).
        """
        sampled: dict[str, int] = {}
        errors: dict[str, Exception] = {}
        if not rows:
            return sampled, errors
        # A row whose sum is finite holds no NaN or infinity (one reduction, not a mask of the whole batch); a sum
        # that overflowed only sends its row to ``sample``, which checks it element by element.
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()  # [num_seqs]
        greedy = logits.argmax(dim=-1).tolist()  # [num_seqs]
        for row, (request_id, params) in zip(rows, requests, strict=True):
            if params.is_greedy and finite[row]:
                sampled[request_id] = greedy[row]
                continue
            try:
                sampled[request_id] = self.sample(logits[row], request_id, params)
            except Exception as error:  # noqa: BLE001 - one request's failure (bad logits, a bad parameter) is its own
                errors[request_id] = error
        return sampled, errors

    def sample(self, logits: torch.Tensor, request_id: str, params: SamplingParams) -> int:
        """The next token for one request from its logits ``[vocab_size]``; non-finite logits raise."""
        finite = torch.isfinite(logits)  # [vocab_size]
        if not bool(finite.all()):
            num_nan = int(torch.isnan(logits).sum())
            raise NonFiniteLogitsError(request_id, num_nan, int((~finite).sum()) - num_nan, logits.numel())
        if params.is_greedy:
            return int(logits.argmax())
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
            self.generators[request_id] = generator
        probs = torch.softmax(logits.to("cpu", torch.float32) / params.temperature, dim=-1)  # [vocab_size]
        q = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / q).argmax())

    def get_state(self) -> dict[str, tuple[torch.Generator, torch.Tensor]]:
        """Every request's generator and its state, for ``set_state`` to put back (an undone step draws nothing)."""
        return {request_id: (generator, generator.get_state()) for request_id, generator in self.generators.items()}

    def set_state(self, states: dict[str, tuple[torch.Generator, torch.Tensor]]) -> None:
        """The generators as ``get_state`` saw them, rewound: those made since are forgotten, those dropped return."""
        self.generators = {request_id: generator for request_id, (generator, _) in states.items()}
        for generator, state in states.values():
            generator.set_state(state)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the generators of finished requests."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
