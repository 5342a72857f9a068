"""Each rank's CPU threads on the NUMA node of its GPU (deep_cluster's job), or on a core set of its own on CPU.

A GPU's node comes from sysfs by its PCI bus id, without a CUDA context: the bus ids (and UUIDs) are those the
NVIDIA driver lists under ``/proc/driver/nvidia/gpus/*/information``, in PCI order (CUDA's order when
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and for a node of identical GPUs); ``CUDA_VISIBLE_DEVICES`` (indices or
``GPU-`` UUIDs) picks the rank's GPU among them; ``/sys/bus/pci/devices/<bus id>/numa_node`` names its node and
``/sys/devices/system/node/node<N>/cpulist`` that node's cores. On CPU the cores this process may use are split
into disjoint, equal sets, one per rank of the node. The rank then binds its threads there
(``os.sched_setaffinity``, and no more torch threads than cores). Binding that is not possible (no driver file,
no NUMA information, fewer cores than ranks) is a warning naming why, never a failure.

Every path is read under a root (``/`` by default) so the detector is tested on a fake sysfs tree.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("dsinfer")


@dataclass(frozen=True)
class GpuInfo:
    bus_id: str  # "0000:19:00.0", lower case as sysfs names it
    uuid: str  # "GPU-...", or "" when the driver file has none


def parse_cpulist(text: str) -> list[int]:
    """sysfs's cpulist ("0-3,8,10-11") -> [0, 1, 2, 3, 8, 10, 11]; ValueError for anything else."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.extend(range(first, last + 1))
    return cpus


def nvidia_gpus(root: Path) -> list[GpuInfo]:
    """The GPUs the NVIDIA driver lists, in PCI bus order (empty without the driver's proc files)."""
    gpus = []
    for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
        fields = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
        bus = fields.get("Bus Location", info.parent.name).strip().lower()
        gpus.append(GpuInfo(bus, fields.get("GPU UUID", "").strip()))
    return sorted(gpus, key=lambda g: g.bus_id)


def visible_gpu(local_rank: int, gpus: list[GpuInfo], visible: str | None) -> tuple[GpuInfo | None, str]:
    """The GPU of CUDA device ``local_rank`` under ``CUDA_VISIBLE_DEVICES`` = ``visible``; (None, why) when it
    cannot be told."""
    if not gpus:
        return None, "no GPU is listed under /proc/driver/nvidia/gpus (no NVIDIA driver, or a container without it)"
    entries = [e.strip() for e in visible.split(",")] if visible is not None else [str(i) for i in range(len(gpus))]
    if local_rank >= len(entries):
        return None, f"CUDA device {local_rank} is not among CUDA_VISIBLE_DEVICES={visible!r}"
    entry = entries[local_rank]
    if entry.isdigit():
        index = int(entry)
        if index >= len(gpus):
            return None, f"CUDA_VISIBLE_DEVICES entry {entry} is past the {len(gpus)} GPUs the driver lists"
        return gpus[index], ""
    matches = [g for g in gpus if entry.startswith("GPU-") and g.uuid.startswith(entry)]
    if len(matches) != 1:
        return None, f"CUDA_VISIBLE_DEVICES entry {entry!r} names no single GPU the driver lists (MIG or a typo)"
    return matches[0], ""


def numa_cpus_of(bus_id: str, root: Path) -> tuple[list[int], str]:
    """The cores of the NUMA node of the PCI device ``bus_id``; ([], why) when sysfs does not tell."""
    node_file = root / "sys/bus/pci/devices" / bus_id / "numa_node"
    try:
        node = int(node_file.read_text())
    except (OSError, ValueError) as exc:
        return [], f"cannot read {node_file} ({exc})"
    if node < 0:
        return [], f"{node_file} says -1: the machine reports no NUMA node for GPU {bus_id}"
    cpulist = root / f"sys/devices/system/node/node{node}/cpulist"
    try:
        return parse_cpulist(cpulist.read_text()), ""
    except (OSError, ValueError) as exc:
        return [], f"cannot read {cpulist} ({exc})"


def plan_affinity(local_rank: int, local_world: int, device_type: str, allowed: set[int], root: Path = Path("/"),
                  visible: str | None = None) -> tuple[list[int], str]:
    """The cores rank ``local_rank`` of ``local_world`` ranks on this node should run on, within ``allowed``
    (the process's affinity); ([], why) when there is no such set."""
    if device_type == "cuda":
        gpu, why = visible_gpu(local_rank, nvidia_gpus(root), visible)
        if gpu is None:
            return [], why
        cpus, why = numa_cpus_of(gpu.bus_id, root)
        if not cpus:
            return [], why
        mine = sorted(set(cpus) & allowed)
        if not mine:
            return [], f"none of NUMA cores {cpus[0]}-{cpus[-1]} of GPU {gpu.bus_id} is in this process's affinity"
        return mine, ""
    cores = sorted(allowed)
    if len(cores) < local_world:
        return [], f"{len(cores)} cores for {local_world} ranks: no disjoint core sets"
    share = len(cores) // local_world
    return cores[local_rank * share:(local_rank + 1) * share], ""


def bind_rank(local_rank: int, local_world: int, device_type: str, root: Path = Path("/"),
              visible: str | None = None) -> list[int]:
    """Bind this process's threads to ``plan_affinity``'s cores (and cap torch's threads at their count);
    -> the cores, or [] after a warning naming why nothing was bound."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError) as exc:
        logger.warning("rank %d: CPU affinity left as it is: this system cannot report it (%s)", local_rank, exc)
        return []
    cpus, why = plan_affinity(local_rank, local_world, device_type, allowed, root, visible)
    if not cpus:
        logger.warning("rank %d: CPU affinity left as it is: %s", local_rank, why)
        return []
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("rank %d: CPU affinity left as it is: sched_setaffinity(%s) failed (%s)", local_rank,
                       cpus, exc)
        return []
    if torch.get_num_threads() > len(cpus):
        torch.set_num_threads(len(cpus))
    logger.info("rank %d: CPU threads bound to cores %s", local_rank, _ranges(cpus))
    return cpus


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the cpulist spelling)."""
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
