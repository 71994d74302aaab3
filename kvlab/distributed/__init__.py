"""Mirrors ``vllm/distributed/``: the KV cache event publisher (``kv_events``) that carries what core queues."""
