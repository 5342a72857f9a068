"""The calling thread's OpenMP pool is freed before another thread steps the engine (``entrypoints.openmp_pool``):
two pools of idle workers on a machine with as many CPUs as threads make libgomp stop spinning, and decode ran
~25% slower in ``LLM.generate``'s side thread (issue 45; the speed itself: ``benchmarks/step_thread.py``)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.entrypoints.openmp_pool import release_thread_pool

pytestmark = pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info()
                                or not os.path.isdir("/proc/self/task"), reason="torch without OpenMP, or no procfs")


def _num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _await_os_threads(expected: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while _num_os_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _num_os_threads()


def test_release_joins_the_calling_threads_openmp_workers():
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).add_(1.0)  # a parallel region: this thread's pool gets one worker
        with_pool = _num_os_threads()
        assert release_thread_pool() is True
        assert _await_os_threads(with_pool - 1) == with_pool - 1
        assert release_thread_pool() is True  # no pool: nothing to free, still fine
        torch.ones(1 << 20).add_(1.0)  # the next region builds a new pool
        assert _await_os_threads(with_pool) == with_pool
    finally:
        torch.set_num_threads(before_threads)
        release_thread_pool()


def test_generate_steps_in_its_watched_thread_on_cpu_under_the_defaults(tiny_llama_dir, monkeypatch):
    """The step bound is on without DSINFER_STEP_TIMEOUT_S set (it was off on CPU for speed): every step runs
    in generate's side thread, which the caller watches (the stall itself: test_fault_injection.py)."""
    monkeypatch.delenv("DSINFER_STEP_TIMEOUT_S", raising=False)
    llm = LLM(str(tiny_llama_dir), device="cpu")
    stepped_in: set[str] = set()
    step = llm.engine.step

    def recording_step():
        stepped_in.add(threading.current_thread().name)
        return step()

    monkeypatch.setattr(llm.engine, "step", recording_step)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
    assert stepped_in == {"dsinfer-generate"}
