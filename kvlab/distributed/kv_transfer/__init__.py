"""Mirrors ``vllm/distributed/kv_transfer/``: KV connectors that move a KV cache between engines (notebook 11)."""
