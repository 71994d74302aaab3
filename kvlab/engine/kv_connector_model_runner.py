"""A KV connector's worker half, called around each step's forward (vLLM's ``KVConnectorModelRunnerMixin``).

``kv_connector_step`` is vLLM 0.33.0's ``_get_kv_connector_output``
(``vllm/v1/worker/kv_connector_model_runner_mixin.py``) for kvlab's runner: bind the step's metadata,
``start_load_kv``, then the forward, then ``save_kv_layer`` for each layer, ``wait_for_save``,
``get_finished`` and ``get_block_ids_with_load_errors`` into a ``KVConnectorOutput``, and clear the
metadata. It runs in steps that compute nothing too (vLLM's ``kv_connector_no_forward``): a decode
engine waiting for a pull must still hear that it finished. kvlab calls the per-layer hooks
(``wait_for_layer_load`` before, ``save_kv_layer`` after) around the whole forward rather than inside
each attention layer. If the forward raises, the metadata is cleared and nothing is asked of the
connector: what it finished stays to be reported by the next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from kvlab.core.sched.output import KVConnectorOutput, SchedulerOutput


def kv_layer_names(num_layers: int) -> list[str]:
    """The names connectors know the layers' caches by: vLLM's attention layer prefixes."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


@contextlib.contextmanager
def kv_connector_step(connector: Any, scheduler_output: SchedulerOutput, kv_caches: Mapping[str, Any]
                      ) -> Iterator[KVConnectorOutput]:
    """The connector's part of one step around the forward; the ``KVConnectorOutput`` is filled on exit."""
    output = KVConnectorOutput()
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv(None)
        for name in kv_caches:
            connector.wait_for_layer_load(name)
        yield output
    except BaseException:
        connector.clear_connector_metadata()
        raise
    for name, kv_cache in kv_caches.items():
        connector.save_kv_layer(name, kv_cache, None)
    connector.wait_for_save()
    output.finished_sending, output.finished_recving = connector.get_finished(scheduler_output.finished_req_ids)
    output.invalid_block_ids = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()


class KVOutputAggregator:
    """Every rank's ``KVConnectorOutput`` folded into one for the scheduler (vLLM's ``KVOutputAggregator``,
    ``vllm/distributed/kv_transfer/kv_connector/utils.py``).

    Under tensor parallelism each rank's worker half sends and receives its own heads, so a request has
    finished sending (or receiving) only once every rank said so: the count of ranks still to report is
    kept per request across steps. Blocks a load failed to fill on any rank are invalid on all.
    """

    def __init__(self, expected_finished_count: int) -> None:
        self._expected_finished_count = expected_finished_count
        self._send_remaining_count: dict[str, int] = {}
        self._recv_remaining_count: dict[str, int] = {}

    def _update(self, req_ids: set[str] | None, remaining: dict[str, int], finished: set[str]) -> None:
        for req_id in req_ids or ():
            remaining[req_id] = remaining.get(req_id, self._expected_finished_count) - 1
            if remaining[req_id] == 0:
                finished.add(req_id)
                del remaining[req_id]

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's reports, rank by rank, as the one report the scheduler reads."""
        result = KVConnectorOutput()
        sending: set[str] = set()
        recving: set[str] = set()
        for output in outputs:
            if output is None:
                continue
            self._update(output.finished_sending, self._send_remaining_count, sending)
            self._update(output.finished_recving, self._recv_remaining_count, recving)
            result.invalid_block_ids |= output.invalid_block_ids
            result.failed_recving |= output.failed_recving
        result.finished_sending, result.finished_recving = sending or None, recving or None
        return result
