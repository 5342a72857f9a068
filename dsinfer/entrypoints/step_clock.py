"""The time bound on one engine step (``DSINFER_STEP_TIMEOUT_S``), shared by the server's AsyncEngine and the
offline ``LLM``.

A step that hangs (a stuck kernel, a deadlock, an injected ``stall``) cannot be interrupted from Python, so the
thread stepping the engine marks when each step begins and another thread, watching, gives up on it once it has
run past the bound: the engine is declared dead and everyone waiting on it is told, while the stuck thread (a
daemon) is left behind. The mp executor bounds its own steps (it kills a worker that does not answer in time:
``Executor.bounds_step_time``); the clock bounds every step of the in-process one.
"""

from __future__ import annotations

import time

from dsinfer import envs


class StepTimeoutError(RuntimeError):
    """A step ran past ``DSINFER_STEP_TIMEOUT_S`` (the engine is then dead)."""


class StepClock:
    """When the step in progress began: ``begin()`` / ``end()`` from the stepping thread, ``overdue()`` from the
    watching one (a plain attribute read: no lock is needed for one float written by one thread)."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = envs.STEP_TIMEOUT_S.get() if timeout_s is None else timeout_s
        self.started: float | None = None  # time.monotonic() at the step's start; None between steps

    @property
    def poll_s(self) -> float:
        """How often a watcher looks: a tenth of the bound, at most every 0.5 s."""
        return min(0.5, self.timeout_s / 10)

    def begin(self) -> None:
        self.started = time.monotonic()

    def end(self) -> None:
        self.started = None

    def overdue(self) -> StepTimeoutError | None:
        """The error to fail the engine with when the step in progress has run past the bound, else None."""
        started = self.started
        if started is None or time.monotonic() - started <= self.timeout_s:
            return None
        return StepTimeoutError(f"a step ran longer than {self.timeout_s:g}s (DSINFER_STEP_TIMEOUT_S)")
