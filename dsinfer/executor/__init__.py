"""Executors: run the engine's step plans on the model, in this process (``uni``) or in worker processes (``mp``),
chosen by vLLM's ``distributed_executor_backend``. The engine sees one interface (``base.Executor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsinfer.config import EngineConfig
    from dsinfer.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """The executor of ``config.parallel.distributed_executor_backend`` (imported only when chosen)."""
    if config.parallel.distributed_executor_backend == "mp":
        from dsinfer.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    from dsinfer.executor.uni import UniExecutor

    return UniExecutor(config)
