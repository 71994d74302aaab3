"""Many replicas: routers, the fleet simulation over core managers, replicas as processes, their metrics.

``fleet`` sits above the engine and knows a replica only through its KV events, its ``/metrics``
and the requests it is sent, as a router in front of vLLM does.
"""
