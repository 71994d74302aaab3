"""Tensor parallelism when torchrun started the ranks: this process is rank 0 and runs the engine (vLLM's
``ExecutorWithExternalLauncher``, ``distributed_executor_backend="external_launcher"``).

Under ``torchrun --nproc-per-node N -m kvlab.engine.launch ...`` every process joins the world from the
launcher's environment (``env://``); rank 0 builds the ``LLMEngine`` and its executor runs rank 0's
``Worker`` in this process, broadcasting each step to ranks 1..N-1, which run
``kvlab.engine.worker.worker_main`` exactly as the ranks ``MultiprocExecutor`` spawns do. vLLM's
external launcher differs: every rank builds an engine and schedules for itself, trusting the
scheduler to decide identically everywhere, so nothing is sent; kvlab keeps one scheduler and the
broadcast, so ranks 1..N-1 run the same loop under both launchers.
"""

from __future__ import annotations

from typing import Any

from kvlab.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvlab.distributed.parallel_state import destroy_distributed_environment, launcher_env
from kvlab.engine.engine_config import EngineConfig
from kvlab.engine.worker import Driver, check_fault, start_rank
from kvlab.errors import KvlabValueError, RankFailedError


class ExecutorWithExternalLauncher:
    """Rank 0's ``Worker`` in this process, driving the ranks torchrun started (``MultiprocExecutor``'s calls)."""

    def __init__(self, config: EngineConfig) -> None:
        env = launcher_env()
        if env is None:
            raise KvlabValueError("distributed_executor_backend='external_launcher' needs the ranks' environment "
                                  "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): start with torchrun")
        if env["RANK"] != "0":
            raise KvlabValueError(f"RANK={env['RANK']}: under torchrun only rank 0 builds the LLMEngine; the other "
                                  "ranks run kvlab.engine.worker.worker_main() (kvlab.engine.launch does both)")
        if int(env["WORLD_SIZE"]) != config.tensor_parallel_size:
            raise KvlabValueError(f"tensor_parallel_size={config.tensor_parallel_size} but torchrun started "
                                  f"WORLD_SIZE={env['WORLD_SIZE']} ranks: give the same number")
        self.config, self.world_size = config, config.tensor_parallel_size
        self.is_failed = False
        worker, self.world = start_rank(config)
        self.driver = Driver(worker)
        self.load_reports = self.collective_rpc("load_report")
        self.kv_cache_reports: list[dict[str, Any]] = []

    def collective_rpc(self, method: str, *args: Any) -> Any:
        if self.is_failed:
            raise RankFailedError(None, "a rank failed earlier")
        try:
            return self.driver.call(method, *args)
        except Exception as error:
            self.is_failed = True
            raise RankFailedError(0, f"{type(error).__name__}: {error}") from error

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", scheduler_output)

    def initialize_kv_cache(self, num_blocks: int, groups: Any) -> list[dict[str, Any]]:
        self.kv_cache_reports = self.collective_rpc("initialize_kv_cache", num_blocks, groups)
        return self.kv_cache_reports

    def inject_fault(self, rank: int, kind: str = "raise") -> None:
        """Make ``rank`` raise inside (``"raise"``), exit at (``"exit"``) or hang in (``"hang"``) its next step."""
        check_fault(self.world_size, rank, kind)
        self.collective_rpc("inject_fault", rank, kind)

    def shutdown(self) -> None:
        """Tell ranks 1..N-1 to leave their loop, then leave the groups (torchrun ends the processes)."""
        if not self.is_failed and self.driver is not None:
            self.driver.call("shutdown")
        if self.driver is not None:
            self.driver.worker.close()
            destroy_distributed_environment(self.driver.worker.tp_group, self.world)
            self.driver = None
