"""The first code a spawned rank runs: set what a launcher sets, then ``worker_main``.

``MultiprocExecutor`` starts each rank with ``multiprocessing``'s spawn, whose child imports this
small module before anything heavy: the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, the thread count) is in place before torch is imported, exactly as
torchrun leaves it for its children, so ``kvlab.engine.worker.worker_main`` cannot tell the two launchers
apart. (vLLM sets ``OMP_NUM_THREADS`` in the parent before it spawns, ``set_multiprocessing_worker_envs``;
kvlab leaves the parent's environment alone.)
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


def spawned_rank(env: dict[str, str], engine: Connection) -> None:
    """Set the launcher's variables in this (fresh) process, then become a rank."""
    os.environ.update(env)
    from kvlab.engine.worker import worker_main  # torch is imported here, after the thread count is set

    worker_main(engine)
