"""DSINFER_FAULT_INJECT and DSINFER_STEP_TIMEOUT_S offline: a step that raises, hangs or loses its worker makes
``LLM.generate`` raise a clear error in bounded time, with the in-process and the mp executor (the server's side:
tests/server/test_server_worker_death.py)."""

from __future__ import annotations

import time

import pytest

from dsinfer import LLM, SamplingParams, envs
from dsinfer.entrypoints.step_clock import StepTimeoutError
from dsinfer.executor.base import WorkerDiedError
from dsinfer.executor.faults import FaultInjector, InjectedFault

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
LONG = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def test_the_fault_variable_parses_and_refuses_bad_values(monkeypatch):
    monkeypatch.setenv("DSINFER_FAULT_INJECT", "stall:step=3")
    assert envs.FAULT_INJECT.get() == ("stall", 3)
    monkeypatch.setenv("DSINFER_FAULT_INJECT", "off")
    assert envs.FAULT_INJECT.get() is None
    for bad in ("explode:step=1", "raise:step=0", "raise:at=2", "raise"):
        monkeypatch.setenv("DSINFER_FAULT_INJECT", bad)
        with pytest.raises(ValueError, match=f"DSINFER_FAULT_INJECT={bad!r} is invalid"):
            envs.FAULT_INJECT.get()


def test_the_injector_fires_in_step_n_only():
    faults = FaultInjector(("raise", 2), in_worker=False)
    faults.before_step()
    with pytest.raises(InjectedFault, match="raise in step 2"):
        faults.before_step()
    faults.before_step()  # once only
    with pytest.raises(ValueError, match="needs the mp executor"):
        FaultInjector(("kill", 1), in_worker=False)


def test_a_raising_step_fails_generate_and_the_llm_stays_usable(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DSINFER_FAULT_INJECT", "raise:step=3")
    llm = LLM(str(tiny_llama_dir), device="cpu")
    with pytest.raises(InjectedFault, match="injected fault: raise in step 3"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_a_stalled_step_in_process_fails_generate_in_bounded_time_and_the_llm_says_it_is_dead(
        tiny_llama_dir, monkeypatch):
    """The in-process executor cannot interrupt a hung step: generate() steps in a thread of its own and raises
    StepTimeoutError once a step runs past DSINFER_STEP_TIMEOUT_S; the LLM then refuses work, naming why."""
    monkeypatch.setenv("DSINFER_FAULT_INJECT", "stall:step=3")
    monkeypatch.setenv("DSINFER_STEP_TIMEOUT_S", "1")
    llm = LLM(str(tiny_llama_dir), device="cpu")
    started = time.monotonic()
    with pytest.raises(StepTimeoutError, match=r"a step ran longer than 1s \(DSINFER_STEP_TIMEOUT_S\)"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    took = time.monotonic() - started
    assert 1 <= took < 5, f"generate raised after {took:.1f}s"
    with pytest.raises(RuntimeError, match=r"this LLM's engine is dead \(StepTimeoutError: a step ran longer"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)


def test_kill_is_refused_in_process_before_the_model_loads(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DSINFER_FAULT_INJECT", "kill:step=1")
    with pytest.raises(ValueError, match="needs the mp executor"):
        LLM(str(tiny_llama_dir), device="cpu")


@pytest.mark.parametrize("fault, error, message", [
    ("raise:step=3", RuntimeError, r"(?s)failed in a step: .*InjectedFault: injected fault: raise in step 3"),
    ("kill:step=3", WorkerDiedError, r"worker process 0 \(pid \d+\) died \(signal 9\)"),
    ("stall:step=3", WorkerDiedError, r"did not finish a step within 1s \(DSINFER_STEP_TIMEOUT_S\) and was killed"),
])
def test_a_worker_fault_fails_generate_in_bounded_time(tiny_llama_dir, monkeypatch, fault, error, message):
    monkeypatch.setenv("DSINFER_FAULT_INJECT", fault)
    monkeypatch.setenv("DSINFER_STEP_TIMEOUT_S", "1")
    llm = LLM(str(tiny_llama_dir), device="cpu", distributed_executor_backend="mp")
    started = time.monotonic()
    try:
        with pytest.raises(error, match=message):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        took = time.monotonic() - started
    finally:
        llm.engine.shutdown()
    assert took < 10, f"{fault}: generate raised only after {took:.1f}s"
    assert not llm.engine.executor.process.is_alive()
