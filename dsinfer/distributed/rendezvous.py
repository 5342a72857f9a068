"""How the ranks of one engine find each other.

Two ways to start them:
- **dsinfer spawns them** (one node: ``LLM(tensor_parallel_size=N)``, ``dsinfer serve -tp N``): every rank is a
  child of the engine process; they meet on a loopback port, ``MASTER_PORT`` if set, else a free one.
- **a launcher starts them** (several nodes: torchrun, SLURM, Kubernetes): ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK``) are set for every process; ``RANK`` 0's process runs the
  engine, the others follow it (``executor.mp.run_launched_rank``).

Everything that can be wrong is found here, before a model loads: a ``WORLD_SIZE`` that is not the engine's world
size, a missing or malformed variable, a ``MASTER_PORT`` some other process already listens on.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from dsinfer import envs

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and which of them this process starts."""

    master_addr: str
    master_port: int
    world_size: int
    launched_rank: int | None = None  # the launcher's RANK of this process; None: dsinfer spawns every rank
    launched_local_rank: int = 0  # its LOCAL_RANK (the GPU of the node it drives)

    @property
    def launched(self) -> bool:
        return self.launched_rank is not None

    @property
    def spawned_ranks(self) -> list[int]:
        """The ranks this process starts as children: all of them, or (launched) rank 0 only, from RANK 0."""
        if not self.launched:
            return list(range(self.world_size))
        return [0] if self.launched_rank == 0 else []

    def local_rank(self, rank: int) -> int:
        """The GPU index on its node of ``rank`` (a rank this process starts or is)."""
        return self.launched_local_rank if self.launched else rank

    @property
    def url(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @classmethod
    def resolve(cls, world_size: int) -> Rendezvous:
        """From the launcher's variables when it set them (``RANK`` / ``WORLD_SIZE``), else a loopback rendezvous
        for spawned ranks; ValueError for a mismatch or a malformed variable."""
        env = envs.launcher_env()
        if "RANK" not in env and "WORLD_SIZE" not in env:
            port = _port(env["MASTER_PORT"]) if "MASTER_PORT" in env else free_port()
            rdv = cls(env.get("MASTER_ADDR", LOOPBACK), port, world_size)
        else:
            missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
            if missing:
                raise ValueError(f"the launcher set {sorted(env)} but not {missing}: torchrun and SLURM jobs need "
                                 "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process")
            launched_world = _int("WORLD_SIZE", env["WORLD_SIZE"], 1)
            if launched_world != world_size:
                raise ValueError(f"WORLD_SIZE={launched_world} (set by the launcher) does not match the engine's "
                                 f"world size tensor_parallel_size={world_size}: start one process per rank, "
                                 f"{world_size} in all, or change tensor_parallel_size")
            rank = _int("RANK", env["RANK"], 0)
            if rank >= launched_world:
                raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={launched_world})")
            local = _int("LOCAL_RANK", env.get("LOCAL_RANK", "0"), 0)
            rdv = cls(env["MASTER_ADDR"], _port(env["MASTER_PORT"]), world_size, rank, local)
        rdv.check_port()
        return rdv

    def check_port(self) -> None:
        """A ValueError when the process that will host the rendezvous store finds its port taken (dsinfer's
        spawned ranks, or RANK 0 unless torchrun's agent already hosts the store there)."""
        hosts = not self.launched or (self.launched_rank == 0 and not envs.torchelastic_agent_store())
        if hosts and port_in_use(self.master_port):
            raise ValueError(f"MASTER_PORT={self.master_port} is already in use on this machine (another job's "
                             "rendezvous?): pick a free port, or unset MASTER_PORT and dsinfer picks one")


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether some process listens on ``port`` (any interface: the store binds them all)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no owner
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _int(name: str, raw: str, low: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name}={raw!r} (set by the launcher) must be an integer >= {low}")
    return value


def _port(raw: str) -> int:
    port = _int("MASTER_PORT", raw, 1)
    if port > 65535:
        raise ValueError(f"MASTER_PORT={raw!r} must be a TCP port in [1, 65535]")
    return port
