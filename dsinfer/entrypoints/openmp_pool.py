"""Handing torch's CPU work to another thread without slowing it down: one OpenMP thread pool, not two.

libgomp (the OpenMP runtime of torch's CPU kernels, MKL and ``ops/csrc/cpu_quant.cpp``) keeps a pool of worker
threads per thread that opens parallel regions. Between regions an idle worker spins ``GOMP_SPINCOUNT`` times
before it sleeps (``import dsinfer`` sets 10M: ``DSINFER_CPU_SPIN_COUNT``), so a decode step's ~120 small regions
find it awake, except when libgomp counts more threads of its own than CPUs: then every wait spins 100 times
only, and each region wakes its workers through a futex. The thread that built the engine holds a pool (its
warm-up ran the model); a second thread that then steps the engine gets a second pool, the count passes the CPUs
(4 > 2 on a 2-core machine at 2 threads), and decode ran ~20-30% slower than on the first thread
(``benchmarks/step_thread.py``, docs/benchmarks.md "Stepping in a side thread").

``release_thread_pool()``, called by a thread about to hand the engine to another, frees its own pool
(``omp_pause_resource_all(omp_pause_soft)``: libgomp joins that thread's idle workers); its next parallel region,
if any, builds a new one. Other OpenMP runtimes (Intel's libiomp5, LLVM's libomp) and torch builds without
OpenMP are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's own copy in pip wheels), or None where none is loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/libgomp" in line}
    if len(paths) != 1:  # none (no OpenMP, or another runtime), or two copies: which pool is whose is unclear
        return None
    lib = ctypes.CDLL(paths.pop())
    if not hasattr(lib, "omp_pause_resource_all"):  # before OpenMP 5.0 (GCC 9)
        return None
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (see the module doc); True where one was freed or none was
    held, False where this process's OpenMP runtime is not one this knows how to ask, or the call came from
    inside a parallel region."""
    lib = _libgomp()
    if lib is None:
        return False
    released = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not released:
        logger.debug("omp_pause_resource_all refused to free this thread's OpenMP pool")
    return released
