"""Fault injection for reliability tests (``DSINFER_FAULT_INJECT``): a fault in the model's N-th step.

The executor owns one ``FaultInjector`` and calls ``before_step()`` as each step is launched (in the worker process
for the mp executor). ``raise`` raises ``InjectedFault`` in step N; ``stall`` sleeps in it far longer than any
watchdog waits; ``kill`` sends the process SIGKILL (only where the model runs in a worker process: in-process it
would kill the server without answering its clients, so it is refused at start-up).
"""

from __future__ import annotations

import os
import signal
import time

from dsinfer import envs

STALL_S = 3600.0  # an injected stall: longer than any step timeout a test sets


class InjectedFault(RuntimeError):
    """The exception ``raise:step=N`` injects."""


class FaultInjector:
    def __init__(self, fault: tuple[str, int] | None, in_worker: bool):
        if fault is not None and fault[0] == "kill" and not in_worker:
            raise ValueError("DSINFER_FAULT_INJECT=kill:step=N needs the mp executor "
                             "(--distributed-executor-backend mp): in-process it would kill the server itself")
        self.fault = fault
        self.num_steps = 0

    @classmethod
    def from_env(cls, in_worker: bool) -> FaultInjector:
        return cls(envs.FAULT_INJECT.get(), in_worker)

    def before_step(self) -> None:
        self.num_steps += 1
        if self.fault is None or self.num_steps != self.fault[1]:
            return
        kind, step = self.fault
        if kind == "raise":
            raise InjectedFault(f"injected fault: raise in step {step} (DSINFER_FAULT_INJECT)")
        if kind == "stall":
            time.sleep(STALL_S)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
