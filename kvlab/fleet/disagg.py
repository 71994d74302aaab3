"""1P1D: a proxy in front of a prefill engine and a decode engine, as vLLM's disaggregated-serving examples run.

Each request goes to the **prefill** engine (``kv_role="kv_producer"``) with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": True}``, then to the **decode** engine (``"kv_consumer"``):

* with a connector that returns ``kv_transfer_params`` (``P2pGlooConnector``, NIXL's handshake), the
  same prompt and those parameters: the decode engine pulls the prefill's blocks, computes the prompt's
  last token again, and generates every output token, the first included;
* with one that returns none (``ExampleConnector``: the KV waits in files), the prompt plus the token the
  prefill generated, and one token fewer to go: the decode engine finds the files by the prompt's tokens.

Either way the tokens are the colocated engine's. ``step()`` moves finished prefills across, then steps
the decode engine and the prefill engine once each (the prefill engine also while it only holds blocks
for a pull: it frees them when its worker reports them sent). ``abort`` works in every phase: on the
prefill engine; between the halves, by sending the request to the decode engine and aborting it there
at once, whose connector then tells the prefill engine to let the blocks go (vLLM's path for a request
the decode side rejects); or on the decode engine, whose blocks wait for a pull in flight to end.

Both engines are ``LLMEngine`` objects in this process, so the proxy calls them directly; vLLM's proxy
speaks HTTP to two servers. Nothing else differs: the engines exchange the KV through their connectors.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from kvlab._validate import positive_int
from kvlab.errors import KvlabValueError, RequestStateError

PREFILL, TRANSFER, DECODE, DONE = "prefill", "transfer", "decode", "done"


@dataclasses.dataclass
class DisaggRequest:
    """One request through the proxy: its phase, its id on each engine, and the tokens the client sees."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    phase: str = PREFILL
    first_token: int | None = None  # what the prefill generated
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class DisaggProxy:
    """Send each request to ``prefill`` (max_tokens=1), then to ``decode`` with what the prefill returned."""

    def __init__(self, prefill: Any, decode: Any) -> None:
        for name, engine, roles in (("prefill", prefill, ("kv_producer", "kv_both")),
                                    ("decode", decode, ("kv_consumer", "kv_both"))):
            kvt = getattr(getattr(engine, "engine_config", None), "kv_transfer_config", None)
            if kvt is None or kvt.kv_role not in roles or kvt.kv_connector == "OffloadingConnector":
                raise KvlabValueError(f"{name} must be an LLMEngine whose kv_transfer_config has a connector that "
                                      f"moves KV between engines and kv_role in {list(roles)}")
        self.prefill, self.decode = prefill, decode
        self.requests: dict[str, DisaggRequest] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    # ----------------------------------------------------------------- requests

    def add_request(self, prompt: Sequence[int], max_tokens: int = 16, request_id: str | None = None) -> str:
        """Send a prompt to the prefill engine; the decode engine gets it once the prefill is done."""
        positive_int("max_tokens", max_tokens)
        while request_id is None or request_id in self.prefill.outputs or request_id in self.decode.outputs:
            request_id = f"pd-{next(self._ids)}"  # an id neither engine has seen (they may serve other proxies too)
            if request_id in self.requests:
                request_id = None
        if request_id in self.requests:
            raise RequestStateError(f"request id {request_id!r} was used already")
        prompt = self.prefill.encode(prompt)
        self.prefill.add_request(prompt, max_tokens=1, request_id=request_id,
                                 kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        self.requests[request_id] = DisaggRequest(request_id, prompt, max_tokens)
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; neither engine keeps its blocks for long (see the module)."""
        request = self.requests.get(request_id)
        if request is None or request.phase == DONE:
            return
        if request.phase == PREFILL:
            self.prefill.abort_request(request_id)
        elif request.phase == TRANSFER:
            if request.kv_transfer_params is not None:  # let the decode side release the prefill's blocks
                self._send_to_decode(request)
                self.decode.abort_request(request_id)
        else:
            self.decode.abort_request(request_id)
        request.phase, request.finish_reason = DONE, "abort"

    def has_unfinished_requests(self) -> bool:
        return any(r.phase != DONE for r in self.requests.values())

    def has_requests(self) -> bool:
        """Unfinished requests, or blocks an engine still holds for a transfer."""
        return self.has_unfinished_requests() or self.prefill.has_requests() or self.decode.has_requests()

    # ----------------------------------------------------------------- the loop

    def step(self) -> None:
        """Move finished prefills to the decode engine, then step the decode and the prefill engine once each."""
        self.num_steps += 1
        for request in self.requests.values():
            if request.phase == TRANSFER:
                self._send_to_decode(request)
        if self.decode.has_requests():
            for out in self.decode.step():
                self._from_decode(out)
        if self.prefill.has_requests():
            for out in self.prefill.step():
                self._from_prefill(out)

    def _from_prefill(self, out: Any) -> None:
        request = self.requests.get(out.request_id)
        if request is None or request.phase != PREFILL or not out.finished:
            return
        if out.finish_reason not in ("length", "stop"):
            request.phase, request.finish_reason = DONE, out.finish_reason
            return
        request.first_token = out.new_token_ids[0]
        request.kv_transfer_params = out.kv_transfer_params
        if request.kv_transfer_params is None and (out.finish_reason == "stop" or request.max_tokens == 1):
            request.output_token_ids = [request.first_token]  # nothing left to decode
            request.phase, request.finish_reason = DONE, out.finish_reason
            return
        request.phase = TRANSFER

    def _send_to_decode(self, request: DisaggRequest) -> None:
        if request.kv_transfer_params is not None:  # NIXL's way: the same prompt, the prefill's parameters
            self.decode.add_request(request.prompt, max_tokens=request.max_tokens, request_id=request.request_id,
                                    kv_transfer_params=request.kv_transfer_params)
        else:  # the example connector's way: the prompt and its first token, found in the files by its tokens
            request.output_token_ids = [request.first_token]
            self.decode.add_request([*request.prompt, request.first_token], max_tokens=request.max_tokens - 1,
                                    request_id=request.request_id)
        request.phase = DECODE

    def _from_decode(self, out: Any) -> None:
        request = self.requests.get(out.request_id)
        if request is None or request.phase != DECODE:
            return
        request.output_token_ids += out.new_token_ids
        if out.finished:
            request.phase, request.finish_reason = DONE, out.finish_reason

    def run(self, max_steps: int = 100_000) -> int:
        """Step until every request finished and neither engine holds blocks for a transfer; returns the steps."""
        taken = 0
        while self.has_requests():
            if taken >= max_steps:
                raise RequestStateError(f"requests or transfers were still pending after max_steps={max_steps}")
            self.step()
            taken += 1
        return taken

    def generate(self, prompts: Iterable[Sequence[int]], max_tokens: int = 16) -> list[list[int]]:
        """Each prompt through both engines; its tokens, as a colocated ``LLMEngine.generate`` gives them."""
        ids = [self.add_request(p, max_tokens) for p in prompts]
        self.run()
        return [self.requests[i].output_token_ids for i in ids]


class MeasuredEngine:
    """A real ``LLMEngine`` as a ``kvlab.sim.disaggregation.Stepper``: each step's seconds are its CPU time here.

    On a prefill engine (``kv_role`` producer) a request goes in with ``do_remote_decode``, and a step in which
    one finished is followed by an idle step, so its worker learns at once which blocks to hold for the pull.
    On a decode engine a ``remote`` request goes in with the ``kv_transfer_params`` its ``peer`` returned; when
    nothing but pulls is left to do, the engine waits for them and counts each pull's measured seconds (the
    gloo copy on this machine) instead of idling step after step. The clock counts CPU seconds of the whole
    process during a step (torch's threads included), so other work on a shared machine does not inflate it.
    """

    def __init__(self, engine: Any, peer: Any = None) -> None:
        self.engine, self.peer = engine, peer
        kvt = engine.engine_config.kv_transfer_config
        self.is_producer = kvt is not None and kvt.is_kv_producer and peer is None
        self.clock = 0.0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, remote: bool = False) -> None:
        params = ({"do_remote_decode": True, "do_remote_prefill": False} if self.is_producer
                  else self.peer.kv_transfer_params[request_id] if remote else None)
        self.engine.add_request(prompt, max_tokens=max_tokens, request_id=request_id, ignore_eos=True,
                                kv_transfer_params=params)

    def has_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> tuple[list[Any], float]:
        import time

        waited = self._wait_for_pulls()
        started = time.process_time()
        outputs = self.engine.step()
        if self.is_producer and any(o.finished for o in outputs):
            self.engine.step()  # hand the worker the blocks to hold before the decode side asks for them
        return outputs, time.process_time() - started + waited

    def _wait_for_pulls(self) -> float:
        """If only pulls are left, wait until one ends; return its measured seconds (0 otherwise)."""
        import time

        scheduler, worker = self.engine.scheduler, self.engine.kv_connector_worker
        if worker is None or scheduler.running or scheduler.waiting or scheduler.finished_recving_kv_req_ids:
            return 0.0
        pulls = getattr(getattr(worker, "connector_worker", None), "pull_seconds", None)
        if pulls is None or not scheduler.kv_holding_waiting:
            return 0.0
        before = set(pulls)
        deadline = time.perf_counter() + 30
        while set(pulls) == before and time.perf_counter() < deadline:
            time.sleep(0.001)
        return sum(pulls[r] for r in set(pulls) - before)
