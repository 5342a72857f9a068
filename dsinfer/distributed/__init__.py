"""Scale-out on ``torch.distributed``: which rank a process is and the groups it talks over (``state``), how
ranks find each other (``rendezvous``: torchrun / SLURM variables, or a loopback port when dsinfer spawns its own
ranks), the process groups (``groups``) and each rank's CPU affinity (``numa``).

The sharded layers themselves live in ``layers`` (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ...): each parameter's weight loader takes its rank's slice, so models read like the
paper. A forward gets its ``ParallelState`` at construction, never from a module-level global.
"""

from dsinfer.distributed.state import SINGLE, ParallelState, split_evenly

__all__ = ["SINGLE", "ParallelState", "split_evenly"]
