"""The in-process executor (the default): the engine calls the runner directly, as fast as no executor at all."""

from __future__ import annotations

from dsinfer.config import EngineConfig
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import StepPlan
from dsinfer.executor.base import Executor, StepResult
from dsinfer.runner.model_runner import ModelRunner


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_blocks
        self.num_state_slots = self.runner.num_state_slots
        self.kv_group_windows = self.runner.kv_group_windows
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token
        self.step_latency_points = self.runner.step_latency_points

    def launch(self, plan: StepPlan) -> StepResult:
        return self.runner.launch(plan)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        self.runner.close()
