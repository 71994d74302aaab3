"""The scheduler (``scheduler.py``) and the types of one step (``output.py``), as in ``vllm/v1/core/sched/``."""
