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
