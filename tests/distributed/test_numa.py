"""NUMA / CPU affinity on a fake sysfs tree: a GPU's node from its PCI bus id (no CUDA context), the rank's GPU
from CUDA_VISIBLE_DEVICES (indices or UUIDs), disjoint core sets on CPU, and a warning, not a failure, naming why
when nothing can be bound."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from dsinfer.distributed import numa

GPUS = {"0000:19:00.0": ("GPU-aaaa-1111", 0), "0000:9a:00.0": ("GPU-bbbb-2222", 1), "0000:1b:00.0": ("GPU-cccc", -1)}
NODES = {0: "0-3,8-11", 1: "4-7,12-15"}
ALL = set(range(16))


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    for bus, (uuid, node) in GPUS.items():
        info = tmp_path / "proc/driver/nvidia/gpus" / bus / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t NVIDIA H200\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\nDevice Minor: \t 0\n")
        pci = tmp_path / "sys/bus/pci/devices" / bus
        pci.mkdir(parents=True)
        (pci / "numa_node").write_text(f"{node}\n")
    for node, cpus in NODES.items():
        d = tmp_path / f"sys/devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return tmp_path


def test_cpulist_parsing():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError):
        numa.parse_cpulist("3-1")


def test_gpus_are_listed_in_pci_order_and_each_finds_its_node(sysfs):
    assert [g.bus_id for g in numa.nvidia_gpus(sysfs)] == ["0000:19:00.0", "0000:1b:00.0", "0000:9a:00.0"]
    assert numa.plan_affinity(0, 3, "cuda", ALL, sysfs) == ([0, 1, 2, 3, 8, 9, 10, 11], "")
    assert numa.plan_affinity(2, 3, "cuda", ALL, sysfs) == ([4, 5, 6, 7, 12, 13, 14, 15], "")
    # the process's own affinity bounds the set (a container's cpuset)
    assert numa.plan_affinity(0, 3, "cuda", {1, 2, 5}, sysfs) == ([1, 2], "")


def test_cuda_visible_devices_picks_the_gpu_by_index_or_uuid(sysfs):
    assert numa.plan_affinity(0, 1, "cuda", ALL, sysfs, visible="2")[0] == [4, 5, 6, 7, 12, 13, 14, 15]
    assert numa.plan_affinity(1, 2, "cuda", ALL, sysfs, visible="0,GPU-bbbb")[0] == [4, 5, 6, 7, 12, 13, 14, 15]
    cpus, why = numa.plan_affinity(0, 1, "cuda", ALL, sysfs, visible="MIG-1234")
    assert cpus == [] and "names no single GPU" in why
    cpus, why = numa.plan_affinity(1, 2, "cuda", ALL, sysfs, visible="0")
    assert cpus == [] and "not among CUDA_VISIBLE_DEVICES='0'" in why


def test_missing_numa_information_says_why(sysfs, tmp_path):
    cpus, why = numa.plan_affinity(1, 3, "cuda", ALL, sysfs)  # 0000:1b:00.0 reports -1
    assert cpus == [] and "reports no NUMA node for GPU 0000:1b:00.0" in why
    cpus, why = numa.plan_affinity(0, 1, "cuda", ALL, tmp_path / "empty")
    assert cpus == [] and "no GPU is listed under /proc/driver/nvidia/gpus" in why
    cpus, why = numa.plan_affinity(0, 3, "cuda", {20, 21}, sysfs)
    assert cpus == [] and "in this process's affinity" in why


def test_cpu_ranks_get_disjoint_core_sets():
    sets = [numa.plan_affinity(r, 3, "cpu", set(range(7)))[0] for r in range(3)]
    assert sets == [[0, 1], [2, 3], [4, 5]]
    cpus, why = numa.plan_affinity(2, 3, "cpu", {0, 1})
    assert cpus == [] and "2 cores for 3 ranks" in why


def test_binding_that_cannot_happen_is_a_warning_and_leaves_the_affinity(tmp_path, caplog):
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="dsinfer"):
        assert numa.bind_rank(0, 1, "cuda", root=tmp_path) == []
    assert os.sched_getaffinity(0) == before
    assert "rank 0: CPU affinity left as it is: no GPU is listed" in caplog.text


def test_a_cpu_rank_binds_to_its_share(caplog):
    before = os.sched_getaffinity(0)
    try:
        with caplog.at_level(logging.INFO, logger="dsinfer"):
            cpus = numa.bind_rank(0, 1, "cpu")
        assert cpus == sorted(before) and os.sched_getaffinity(0) == before
        assert "CPU threads bound to cores" in caplog.text
    finally:
        os.sched_setaffinity(0, before)
