"""The executor interface: what the engine asks of the workers that hold the model.

``launch(plan)`` queues a step and returns a handle whose ``result()`` gives its ``RunnerOutput``; handles are
resolved in launch order (a step launched before the previous one's result is read overlaps that wait, as async
scheduling wants). ``num_kv_blocks`` is known once the workers have sized their caches. A worker that dies or
stops answering makes ``result()`` raise ``WorkerDiedError`` within a bounded time, never hang.
"""

from __future__ import annotations

import abc
from typing import Protocol

from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import StepPlan
from dsinfer.core.step_latency import DecodePadding


class WorkerDiedError(RuntimeError):
    """A worker process died or stopped answering: the engine cannot go on (every request fails)."""


class StepResult(Protocol):
    def result(self) -> RunnerOutput: ...


class Executor(abc.ABC):
    num_kv_blocks: int
    num_state_slots: int  # per-sequence state slots (0: the model keeps no per-sequence state)
    kv_group_windows: tuple[int | None, ...]  # per KV cache group, its sliding window (None: full attention)
    kv_bytes_per_token: int
    # routed-expert storage slots one rank holds per MoE layer (expert parallelism: its share; 0 without MoE)
    num_local_expert_slots: int
    step_latency_points: dict[int, float]  # the runner's step-latency curve at start-up (confidence scheduling)
    decode_padding: DecodePadding = DecodePadding()  # the steps the runner pads to their longest query (its graphs)
    # True where the executor itself fails a step that runs past DSINFER_STEP_TIMEOUT_S (the mp executor kills a
    # worker that does not answer in time); elsewhere its caller bounds the step (entrypoints.step_clock)
    bounds_step_time: bool = False

    @abc.abstractmethod
    def launch(self, plan: StepPlan) -> StepResult:
        """Queue the step; no wait for the device."""

    def execute(self, plan: StepPlan) -> RunnerOutput:
        return self.launch(plan).result()

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
