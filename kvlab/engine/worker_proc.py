"""The first code a spawned rank runs: set what a launcher sets, then ``worker_main``.

``MultiprocExecutor`` starts each rank with ``multiprocessing`` (forked from its fork server on a CPU,
spawned on GPUs; ``rank_context``), and the child runs this first: the environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, the thread count) is in place before the
rank joins, exactly as torchrun leaves it for its children, so ``kvlab.engine.worker.worker_main`` cannot
tell the two launchers apart. (vLLM sets ``OMP_NUM_THREADS`` in the parent before it spawns,
``set_multiprocessing_worker_envs``; kvlab leaves the parent's environment alone.)
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


def spawned_rank(env: dict[str, str], engine: Connection) -> None:
    """Set the launcher's variables in this process, then become a rank.

    A rank forked from the fork server finds torch imported already, so its thread count is set by call too.
    """
    os.environ.update(env)
    import torch  # a spawned rank imports it here, after the thread count is in the environment

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from kvlab.engine.worker import worker_main

    worker_main(engine)
