"""Mirrors ``vllm/distributed/``: ranks and groups on ``torch.distributed`` (``parallel_state``, which the engine's
tensor-parallel layers take their groups from) and the KV cache event publisher (``kv_events``) that carries what
core queues."""
