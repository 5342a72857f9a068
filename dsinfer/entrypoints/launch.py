"""Processes of a launched job (torchrun, SLURM, Kubernetes: ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT`` set for each) that are not rank 0: they run no engine, server or prompt; they join rank 0's engine
and run every step it plans with it (``executor.mp.run_launched_rank``), until it shuts down.

``dsinfer serve`` and ``dsinfer generate`` call ``follow_if_launched`` first: on RANK 0 (or outside a launched
job) it returns None and the command goes on; elsewhere it follows and returns the exit code.
"""

from __future__ import annotations

from typing import Any

from dsinfer import envs


def launched_rank() -> int | None:
    """This process's RANK in a launched job of more than one process; None outside one."""
    env = envs.launcher_env()
    if "RANK" not in env or env.get("WORLD_SIZE", "1") == "1":
        return None
    try:
        return int(env["RANK"])
    except ValueError:
        raise ValueError(f"RANK={env['RANK']!r} (set by the launcher) must be an integer >= 0") from None


def follow_if_launched(engine_args: Any, usage: str) -> int | None:
    """Follow rank 0 when this is a launched process of RANK >= 1 (-> its exit code); None otherwise."""
    rank = launched_rank()
    if rank is None or rank == 0:
        return None
    from dsinfer.executor.mp import run_launched_rank

    return run_launched_rank(engine_args.create_engine_config(usage))
