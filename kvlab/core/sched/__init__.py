"""The scheduler (``scheduler.py``), its knobs (``config.py``, vLLM's ``vllm/config/scheduler.py``) and the
types of one step (``output.py``), as in ``vllm/v1/core/sched/``."""
