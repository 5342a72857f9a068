"""A dead engine ends the server: its in-flight requests fail naming what died, /health and new requests get 503,
and the process exits non-zero soon after, for an orchestrator to restart it (as vLLM's).

The live tests run a real ``dsinfer serve`` and, mid-generation, kill its model's worker process
(``--distributed-executor-backend mp``) or inject a fault with ``DSINFER_FAULT_INJECT`` (a step that raises,
hangs past ``DSINFER_STEP_TIMEOUT_S`` or kills the worker, in-process and mp); the fast ones drive AsyncEngine
and DrainingServer's watcher with a fake engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.entrypoints.async_engine import AsyncEngine, EngineCrashedError, EngineDeadError
from dsinfer.executor.base import WorkerDiedError
from dsinfer.server.cli import add_serve_args, engine_args
from dsinfer.server.lifecycle import DrainingServer

from ..protocol.tiny_tokenizer import write_tiny_tokenizer
from .live_server import API_KEY, start_tiny_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# long enough to be in flight when the worker is killed; the tiny model's vocabulary is 256 ids
LONG = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True}


def test_the_executor_backend_flag_reaches_engine_args_and_refuses_other_values(capsys):
    parser = add_serve_args(argparse.ArgumentParser())
    assert "--distributed-executor-backend {uni,mp}" in parser.format_help()
    assert engine_args(parser.parse_args(["m", "--distributed-executor-backend", "mp"])).distributed_executor_backend \
        == "mp"
    assert engine_args(parser.parse_args(["m"])).distributed_executor_backend is None  # the engine's default: uni
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["m", "--distributed-executor-backend", "ray"])
    assert refused.value.code == 2 and "invalid choice: 'ray'" in capsys.readouterr().err


class _DyingEngine:
    """An LLMEngine stand-in whose step() raises ``WorkerDiedError`` once ``alive`` is cleared."""

    def __init__(self):
        self.tokenizer = SimpleNamespace()
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=100)
        self.alive = threading.Event()
        self.alive.set()
        self.requests: set[str] = set()
        self.shutdowns = 0

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        self.requests.add(request_id)

    def abort_request(self, ids):
        self.requests.difference_update(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        time.sleep(0.005)
        if not self.alive.is_set():
            raise WorkerDiedError("worker process 0 (pid 4242) died (signal 9); the engine cannot go on")
        return []

    def get_stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_cache_usage": 0.0}

    def shutdown(self) -> None:
        self.shutdowns += 1


async def _drain(engine: AsyncEngine, request_id: str) -> None:
    async for _ in engine.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=10), request_id):
        pass


def test_a_crash_fails_the_request_in_flight_with_the_cause_and_refuses_new_ones():
    fake = _DyingEngine()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        in_flight = asyncio.ensure_future(_drain(engine, "a"))
        await asyncio.sleep(0.05)
        fake.alive.clear()
        with pytest.raises(EngineCrashedError, match=r"WorkerDiedError: worker process 0 \(pid 4242\) died"):
            await asyncio.wait_for(in_flight, 5)
        with pytest.raises(EngineDeadError, match="the engine is dead") as refused:
            await _drain(engine, "b")
        assert not isinstance(refused.value, EngineCrashedError)  # a new request's answer is the 503, not the 500
        assert engine.dead and "WorkerDiedError" in engine.death_reason
        started = time.monotonic()
        engine.shutdown()
        return time.monotonic() - started

    shutdown_s = asyncio.run(main())
    assert fake.shutdowns == 1 and shutdown_s < 1.0  # the dead engine's workers are stopped, without a hang


def test_the_watchdog_fails_a_request_stuck_in_a_hung_step_and_shutdown_does_not_wait_for_it():
    fake = _DyingEngine()
    release = threading.Event()
    fake.step = lambda: release.wait(30) and []  # a step that hangs until the test releases it

    async def main():
        engine = AsyncEngine(fake, step_timeout_s=0.3)
        engine.start()
        started = time.monotonic()
        with pytest.raises(EngineCrashedError, match=r"StepTimeoutError: a step ran longer than 0.3s"):
            await asyncio.wait_for(_drain(engine, "a"), 5)
        failed_s = time.monotonic() - started
        assert engine.dead and not engine.is_healthy
        with pytest.raises(EngineDeadError, match="the engine is dead"):
            await _drain(engine, "b")
        started = time.monotonic()
        engine.shutdown()
        return failed_s, time.monotonic() - started

    try:
        failed_s, shutdown_s = asyncio.run(main())
    finally:
        release.set()
    assert 0.3 <= failed_s < 2 and shutdown_s < 1 and fake.shutdowns == 1


def test_the_watcher_tells_uvicorn_to_exit_after_the_grace_period():
    engine = SimpleNamespace(dead=False, death_reason="")
    server = DrainingServer(uvicorn.Config(app=None), engine, drain_timeout_s=30, death_grace_s=0.2)

    async def main():
        watcher = asyncio.ensure_future(server.watch_engine())
        await asyncio.sleep(0.3)
        assert not server.should_exit and server.engine_error is None  # a live engine: nothing happens
        engine.dead, engine.death_reason = True, "WorkerDiedError: worker process 0 died"
        await asyncio.sleep(0.2)
        assert server.engine_error == "WorkerDiedError: worker process 0 died" and not server.should_exit
        await asyncio.wait_for(watcher, 1.0)

    asyncio.run(main())
    assert server.should_exit and not server.force_exit


def _worker_pid(server_pid: int, rank: int = 0) -> int:
    """The spawned model worker of ``rank`` among the server's children (not multiprocessing's resource tracker):
    the workers are spawned in rank order, so their pids rise with the rank."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    workers = sorted(int(pid) for pid in children if b"spawn_main" in (cmdline := Path(
        f"/proc/{pid}/cmdline").read_bytes()) and b"resource_tracker" not in cmdline)
    if len(workers) <= rank:
        raise AssertionError(f"no spawned worker of rank {rank} among the children {children} of {server_pid}")
    return workers[rank]


def _stream(url: str, first_chunk: threading.Event, out: dict) -> None:
    """A streamed completion: its data lines, until the server ends the stream."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, headers=HEADERS,
                      timeout=20) as r:
        out["status"], out["lines"] = r.status_code, []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["lines"].append(line.removeprefix("data: "))
                first_chunk.set()


def _whole(url: str, out: dict) -> None:
    out["response"] = httpx.post(f"{url}/v1/completions", json=LONG, headers=HEADERS, timeout=20)


FAULT_STEP = 150  # both requests (400 tokens each) are in flight by then, and far from done
TIMEOUT_S = "2"


@pytest.mark.parametrize("backend, fault, cause", [
    ("mp", None, r"WorkerDiedError: worker process 0 \(pid \d+\) died \(signal 9\)"),  # killed from outside
    ("mp-tp2", None, r"WorkerDiedError: worker process 1 \(pid \d+\) died \(signal 9\)"),  # rank 1 of two
    ("mp", f"kill:step={FAULT_STEP}", r"WorkerDiedError: worker process 0 \(pid \d+\) died \(signal 9\)"),
    ("mp", f"stall:step={FAULT_STEP}",
     r"WorkerDiedError: .*did not finish a step within 2s|StepTimeoutError: a step ran longer than 2s"),
    ("uni", f"raise:step={FAULT_STEP}", r"InjectedFault: injected fault: raise in step 150"),
    ("uni", f"stall:step={FAULT_STEP}", r"StepTimeoutError: a step ran longer than 2s \(DSINFER_STEP_TIMEOUT_S\)"),
], ids=["mp-sigkill", "tp2-sigkill-rank1", "mp-kill", "mp-stall", "uni-raise", "uni-stall"])
def test_an_engine_fault_fails_in_flight_requests_and_the_server_exits_non_zero(
        tiny_llama_dir, tmp_path, backend, fault, cause):
    env = {"DSINFER_STEP_TIMEOUT_S": TIMEOUT_S, **({"DSINFER_FAULT_INJECT": fault} if fault else {})}
    tokenizer = write_tiny_tokenizer(tmp_path / "tok")
    backend, _, tp = backend.partition("-tp")
    extra = ("-tp", tp) if tp else ()
    proc, url, log = start_tiny_server(tmp_path, tiny_llama_dir, tokenizer, backend, *extra, env=env)
    try:
        first_chunk, streamed, whole = threading.Event(), {}, {}
        threads = [threading.Thread(target=_stream, args=(url, first_chunk, streamed)),
                   threading.Thread(target=_whole, args=(url, whole))]
        for t in threads:
            t.start()
        assert first_chunk.wait(20), f"no streamed token in 20s:\n{log.read_text()[-4000:]}"
        faulted = time.monotonic()
        if fault is None:
            time.sleep(0.2)  # the non-streamed one is in the engine by now
            os.kill(_worker_pid(proc.pid, rank=1 if tp else 0), signal.SIGKILL)
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "a request in flight hung after the engine died"
        checked_at = time.monotonic() - faulted
        try:  # within the grace period the server still answers, with 503s
            health = httpx.get(f"{url}/health", timeout=5)
            assert (health.status_code, health.json()) == (503, {"status": "dead"})
            late = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 1}, headers=HEADERS, timeout=5)
            assert late.status_code == 503 and "the engine is dead" in late.json()["error"]["message"]
        except httpx.ConnectError:  # or it has already gone
            assert checked_at > 0.5, f"the server stopped listening only {checked_at:.2f}s after the death"
        code = proc.wait(30)
        exited_s = time.monotonic() - faulted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert code == 1 and exited_s < 30, text[-4000:]
    assert re.search(f"engine died: (?:{cause})", text), text[-4000:]

    assert streamed["status"] == 200 and streamed["lines"][-1] != "[DONE]"
    error = json.loads(streamed["lines"][-1])["error"]  # the stream's last event names what died
    assert re.search(cause, error["message"]), error

    response = whole["response"]  # not streamed: a 500 in OpenAI's envelope, naming what died
    body = response.json()
    message = body["error"]["message"]
    assert response.status_code == 500, body
    assert body == {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    assert message.startswith("the engine died while serving this request (") and re.search(cause, message)
