"""The in-process executor (the default): the engine calls the runner directly, as fast as no executor at all."""

from __future__ import annotations

from dsinfer.config import EngineConfig
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import StepPlan
from dsinfer.executor.base import Executor, StepResult
from dsinfer.executor.faults import FaultInjector
from dsinfer.runner.model_runner import ModelRunner


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self._faults = FaultInjector.from_env(in_worker=False)  # before the model loads: a refused fault is cheap
        self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_blocks
        self.num_state_slots = self.runner.num_state_slots
        self.kv_group_windows = self.runner.kv_group_windows
        self.num_local_expert_slots = self.runner.num_local_expert_slots
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token
        self.step_latency_points = self.runner.step_latency_points
        self.decode_padding = self.runner.decode_padding

    def launch(self, plan: StepPlan) -> StepResult:
        self._faults.before_step()
        return self.runner.launch(plan)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self._faults.before_step()
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        self.runner.close()
