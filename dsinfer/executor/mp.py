"""The multi-process executor: the model lives in a worker process (``torch.multiprocessing``, spawn), which gets
each step plan over a pipe as msgpack bytes (``core.wire``; nothing is unpickled from the pipe) and answers with
the step's ``RunnerOutput``.

Messages, engine -> worker: ``["step", plan]`` (launch it), ``["result"]`` (send the oldest launched step's
output), ``["shutdown"]``. Worker -> engine: ``["ready", {...}]`` once the model is loaded, then
``["output", RunnerOutput]`` or ``["error", text]`` per ``result``. Steps are launched as they come, so with async
scheduling the worker queues step N + 1 before it waits for step N, as the in-process runner does.

A worker that dies (killed, crashed, out of memory) is noticed while the engine waits for it, through the
process sentinel: ``WorkerDiedError`` at once, with its exit code, never a hang. A step whose result has not come
within ``DSINFER_STEP_TIMEOUT_S`` (a hung worker) gets the worker killed and the same ``WorkerDiedError``. The
worker exits when the engine's end of the pipe closes, so no worker outlives its engine.
"""

from __future__ import annotations

import collections
import gc
import logging
import multiprocessing.connection
import os
import traceback
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from dsinfer import envs
from dsinfer.config import EngineConfig
from dsinfer.core import wire
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import StepPlan
from dsinfer.executor.base import Executor, WorkerDiedError
from dsinfer.executor.faults import FaultInjector

logger = logging.getLogger("dsinfer")

_SHUTDOWN_WAIT_S = 10.0


class _StepFuture:
    def __init__(self, executor: MultiprocExecutor):
        self._executor = executor
        self._output: RunnerOutput | None = None
        self.done = False

    def set(self, output: RunnerOutput) -> None:
        self._output, self.done = output, True

    def result(self) -> RunnerOutput:
        self._executor.resolve_until(self)
        return self._output


class MultiprocExecutor(Executor):
    bounds_step_time = True  # a worker that has not answered within DSINFER_STEP_TIMEOUT_S is killed

    def __init__(self, config: EngineConfig):
        FaultInjector.from_env(in_worker=True)  # a bad DSINFER_FAULT_INJECT fails here, before the worker starts
        self._step_timeout_s = envs.STEP_TIMEOUT_S.get()
        ctx = torch_mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # the worker computes with as many threads as the engine's process would (a CPU matmul's sums follow
        # the thread count, and the outputs must be the in-process executor's)
        self.process = ctx.Process(target=run_worker, args=(config, child, 0, torch.get_num_threads()),
                                   name="dsinfer-worker-0", daemon=True)
        self.process.start()
        child.close()
        self._pending: collections.deque[_StepFuture] = collections.deque()
        self._closed = False
        kind, info = self._receive()
        if kind == "error":
            self.shutdown()
            raise RuntimeError(f"the worker process failed to start: {info}")
        self.num_kv_blocks = int(info["num_kv_blocks"])
        self.num_state_slots = int(info["num_state_slots"])
        self.kv_group_windows = tuple(info["kv_group_windows"])
        self.kv_bytes_per_token = int(info["kv_bytes_per_token"])
        self.step_latency_points = {int(t): float(s) for t, s in info["step_latency_points"]}
        logger.info("worker process 0 (pid %d) ready", self.process.pid)

    def launch(self, plan: StepPlan) -> _StepFuture:
        self._send(["step", plan])
        future = _StepFuture(self)
        self._pending.append(future)
        return future

    def resolve_until(self, future: _StepFuture) -> None:
        """Read outputs in launch order until ``future``'s has come."""
        while not future.done:
            if not self._pending:
                raise RuntimeError("a step's result was asked for twice, or after the executor shut down")
            head = self._pending.popleft()
            self._send(["result"])
            kind, payload = self._receive(self._step_timeout_s)
            if kind == "error":
                raise RuntimeError(f"the worker process failed in a step: {payload}")
            head.set(payload)

    def _send(self, message: list[Any]) -> None:
        if self._closed:
            raise WorkerDiedError("the executor was shut down")
        try:
            self._conn.send_bytes(wire.encode(message))
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise self._died() from None

    def _receive(self, timeout_s: float | None = None) -> tuple[str, Any]:
        ready = multiprocessing.connection.wait([self._conn, self.process.sentinel], timeout_s)
        if not ready:
            self.process.kill()
            self._died()
            raise WorkerDiedError(f"worker process 0 (pid {self.process.pid}) did not finish a step within "
                                  f"{timeout_s:g}s (DSINFER_STEP_TIMEOUT_S) and was killed; the engine cannot go on")
        if self._conn not in ready:
            raise self._died()
        try:
            kind, payload = wire.decode(self._conn.recv_bytes())
        except (EOFError, ConnectionResetError, OSError):
            raise self._died() from None
        return kind, payload

    def _died(self) -> WorkerDiedError:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
        self._closed = True
        return WorkerDiedError(f"worker process 0 (pid {self.process.pid}) died ({how}); the engine cannot go on")

    def shutdown(self) -> None:
        if self.process.is_alive() and not self._closed:
            try:
                self._conn.send_bytes(wire.encode(["shutdown"]))
            except OSError:
                pass
        self._closed = True
        self.process.join(timeout=_SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=_SHUTDOWN_WAIT_S)
        self._conn.close()


def run_worker(config: EngineConfig, conn: multiprocessing.connection.Connection, rank: int,
               num_threads: int) -> None:
    """A worker process's main loop (the spawn target): load the model, then serve step plans until told to stop
    or until the engine's end of the pipe closes."""
    from dsinfer.runner.model_runner import ModelRunner

    torch.set_num_threads(num_threads)

    try:
        faults = FaultInjector.from_env(in_worker=True)
        runner = ModelRunner(config)
    except BaseException:  # noqa: BLE001 - the engine must learn why its worker could not start
        conn.send_bytes(wire.encode(["error", traceback.format_exc()]))
        return
    conn.send_bytes(wire.encode(["ready", {"num_kv_blocks": runner.num_blocks, "rank": rank, "pid": os.getpid(),
                                           "kv_bytes_per_token": runner.kv_bytes_per_token,
                                           "num_state_slots": runner.num_state_slots,
                                           "kv_group_windows": list(runner.kv_group_windows),
                                           "step_latency_points": [[t, s] for t, s in
                                                                   runner.step_latency_points.items()]}]))
    # the worker's own objects live as long as it does: its collections walk only what steps make
    gc.collect()
    gc.freeze()
    launched: collections.deque[Any] = collections.deque()  # step handles, or the exception a launch raised
    while True:
        try:
            message = wire.decode(conn.recv_bytes())
        except (EOFError, OSError):
            runner.close()
            return  # the engine is gone
        kind = message[0]
        if kind == "step":
            try:
                faults.before_step()
                launched.append(runner.launch(message[1]))
            except Exception:  # noqa: BLE001 - reported with this step's result
                launched.append(traceback.format_exc())
        elif kind == "result":
            handle = launched.popleft()
            try:
                reply = ["error", handle] if isinstance(handle, str) else ["output", handle.result()]
            except Exception:  # noqa: BLE001
                reply = ["error", traceback.format_exc()]
            conn.send_bytes(wire.encode(reply))
        elif kind == "shutdown":
            runner.close()
            return
