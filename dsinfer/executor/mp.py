"""The multi-process executor: the model lives in worker processes (``torch.multiprocessing``, spawn), one per
tensor-parallel rank. Rank 0's worker gets each step plan over a pipe as msgpack bytes (``core.wire``; nothing
is unpickled from the pipe), hands the same bytes to the other ranks over the control channel
(``distributed.groups``), runs the step with them and answers with the step's ``RunnerOutput``; the other ranks
run the same step and answer nothing.

Messages, engine -> rank 0: ``["step", plan]`` (launch it), ``["result"]`` (send the oldest launched step's
output), ``["shutdown"]``; rank 0 -> the other ranks: the same messages, and ``["ping"]`` while the engine is idle.
Worker -> engine: ``["ready", {...}]`` once the model is loaded, then (rank 0) ``["output", RunnerOutput]`` or
``["error", text]`` per ``result``; another rank writes only ``["error", text]``, when it fails, and exits. Steps are
launched as they come, so with async scheduling the workers queue step N + 1 before they wait for step N, as the
in-process runner does.

A worker that dies (killed, crashed, out of memory) is noticed while the engine waits for any of them, through the
process sentinels: ``WorkerDiedError`` at once, with its rank and exit code, never a hang; the other ranks are then
killed (they would wait in a collective). A step whose result has not come within ``DSINFER_STEP_TIMEOUT_S`` (a
hung worker) gets the workers killed and the same ``WorkerDiedError``. A worker exits when the engine's end of its
pipe closes (the other ranks: when rank 0's control channel breaks), so no worker outlives its engine.

Data parallelism (DP attention, ``data_parallel_size`` > 1): every rank gets its own plans over its own pipe and
answers them (no control broadcast), each from the engine of its rank (``RankExecutor``, ``engine.dp_engine``).

Ranks started by a launcher (torchrun, SLURM: ``distributed.rendezvous``) are not children: ``RANK`` 0's engine
spawns rank 0's worker only, and each other launched process runs ``run_launched_rank`` (``dsinfer serve`` does).
"""

from __future__ import annotations

import collections
import gc
import logging
import multiprocessing.connection
import os
import sys
import threading
import traceback
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from dsinfer import envs
from dsinfer.config import EngineConfig
from dsinfer.core import wire
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import StepPlan
from dsinfer.core.step_latency import DecodePadding
from dsinfer.distributed import numa
from dsinfer.distributed.groups import PING_S, ControlChannel, destroy, init_parallel_state
from dsinfer.distributed.rendezvous import Rendezvous
from dsinfer.distributed.state import SINGLE, ParallelState
from dsinfer.executor.base import Executor, WorkerDiedError
from dsinfer.executor.faults import FaultInjector

logger = logging.getLogger("dsinfer")

_SHUTDOWN_WAIT_S = 10.0
_PEER_DEATH_WAIT_S = 1.0  # a step that failed: how long to look for the death of a peer that caused it


class _StepFuture:
    def __init__(self, resolve: Any):
        self._resolve = resolve  # its executor's resolve_until
        self._output: RunnerOutput | None = None
        self.done = False

    def set(self, output: RunnerOutput) -> None:
        self._output, self.done = output, True

    def result(self) -> RunnerOutput:
        self._resolve(self)
        return self._output


class _Worker:
    """One spawned rank: its process and the engine's end of its pipe."""

    def __init__(self, ctx: Any, config: EngineConfig, rank: int, num_threads: int, rdv: Rendezvous | None):
        self.rank = rank
        self.conn, child = ctx.Pipe(duplex=True)
        # the worker computes with as many threads as the engine's process would (a CPU matmul's sums follow
        # the thread count, and the outputs must be the in-process executor's)
        self.process = ctx.Process(target=run_worker, args=(config, child, rank, num_threads, rdv),
                                   name=f"dsinfer-worker-{rank}", daemon=True)
        self.process.start()
        child.close()

    def describe(self) -> str:
        return f"worker process {self.rank} (pid {self.process.pid})"

    def exit_status(self) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        return f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"


def _take_worker_facts(executor: Any, info: dict[str, Any]) -> None:
    """The sizes and step facts a worker's "ready" reports, as the executor attributes the engine reads."""
    executor.num_kv_blocks = int(info["num_kv_blocks"])
    executor.num_state_slots = int(info["num_state_slots"])
    executor.kv_group_windows = tuple(info["kv_group_windows"])
    executor.kv_bytes_per_token = int(info["kv_bytes_per_token"])
    executor.num_local_expert_slots = int(info["num_local_expert_slots"])
    executor.step_latency_points = {int(t): float(s) for t, s in info["step_latency_points"]}
    executor.decode_padding = DecodePadding(*info["decode_padding"])


class MultiprocExecutor(Executor):
    bounds_step_time = True  # a worker that has not answered within DSINFER_STEP_TIMEOUT_S is killed

    def __init__(self, config: EngineConfig):
        FaultInjector.from_env(in_worker=True)  # a bad DSINFER_FAULT_INJECT fails here, before the worker starts
        self._step_timeout_s = envs.STEP_TIMEOUT_S.get()
        world = config.parallel.world_size
        rdv = None
        if world > 1:
            from dsinfer.models.loader.model_loader import check_parallel_shapes

            rdv = Rendezvous.resolve(world)  # a launcher's mismatch or a busy port: refused before any spawn
            if rdv.launched and config.parallel.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 under a launcher (torchrun / SLURM RANK, WORLD_SIZE) is not "
                                 "supported yet: DP attention spawns its ranks on one node")
            if rdv.launched and rdv.launched_rank != 0:
                raise ValueError(f"RANK={rdv.launched_rank}: only RANK 0 of a launched job runs the engine; the "
                                 "others follow it (dsinfer serve / generate do so by themselves)")
            check_parallel_shapes(config)
        ctx = torch_mp.get_context("spawn")
        ranks = [0] if rdv is None else rdv.spawned_ranks
        self._workers = [_Worker(ctx, config, rank, torch.get_num_threads(), rdv) for rank in ranks]
        self._pending: collections.deque[_StepFuture] = collections.deque()
        self._closed = False
        self._reaping = threading.Lock()
        self._data_parallel = config.parallel.data_parallel_size > 1
        self._infos = self._await_ready()
        info = self._infos[0]
        _take_worker_facts(self, info)
        logger.info("%d worker process(es) ready (rank 0: pid %d)", len(self._workers), self.process.pid)

    def _await_ready(self) -> dict[int, dict[str, Any]]:
        """Every worker's "ready" (in any order); -> each rank's. A worker that fails or dies first: every worker
        is stopped and a RuntimeError says why."""
        waiting = {w.conn: w for w in self._workers}
        sentinels = {w.process.sentinel: w for w in self._workers}
        infos: dict[int, dict[str, Any]] = {}
        while waiting:
            ready = multiprocessing.connection.wait([*waiting, *sentinels])
            conn = next((c for c in ready if c in waiting), None)
            if conn is None:  # a process ended without a word
                worker = sentinels[ready[0]]
                self._kill_all()
                self.shutdown()
                raise RuntimeError(f"{worker.describe()} failed to start: it died ({worker.exit_status()})")
            worker = waiting.pop(conn)
            message = self._read(worker) or ("error", f"it died ({worker.exit_status()})")
            if message[0] == "error":
                self._kill_all()  # the others may wait for it in the rendezvous
                self.shutdown()
                raise RuntimeError(f"{worker.describe()} failed to start: {message[1]}")
            infos[worker.rank] = message[1]
            del sentinels[worker.process.sentinel]
        return infos

    @property
    def process(self) -> multiprocessing.Process:
        """Rank 0's worker process (the one that answers)."""
        return self._workers[0].process

    @property
    def processes(self) -> list[multiprocessing.Process]:
        return [worker.process for worker in self._workers]

    def launch(self, plan: StepPlan) -> _StepFuture:
        return self._launch_on(self._workers[0], self._pending, plan)

    def resolve_until(self, future: _StepFuture) -> None:
        self._resolve_on(self._workers[0], self._pending, future)

    def rank_view(self, rank: int) -> RankExecutor:
        """Data parallelism: the executor of DP rank ``rank``'s engine (its worker, its pipe, its KV blocks)."""
        if not self._data_parallel:
            raise ValueError("rank views are for data_parallel_size > 1 (each rank its own plans)")
        return RankExecutor(self, self._workers[rank], self._infos[rank])

    def _launch_on(self, worker: _Worker, pending: collections.deque, plan: StepPlan) -> _StepFuture:
        self._send(["step", plan], worker)
        future = _StepFuture(lambda f: self._resolve_on(worker, pending, f))
        pending.append(future)
        return future

    def _resolve_on(self, worker: _Worker, pending: collections.deque, future: _StepFuture) -> None:
        """Read ``worker``'s outputs in launch order until ``future``'s has come."""
        while not future.done:
            if not pending:
                raise RuntimeError("a step's result was asked for twice, or after the executor shut down")
            head = pending.popleft()
            self._send(["result"], worker)
            kind, payload = self._receive(worker, self._step_timeout_s)
            if kind == "error":
                self._raise_if_another_died(worker)  # its collective failed because a peer died: say so
                raise RuntimeError(f"the worker process failed in a step: {payload}")
            head.set(payload)

    def _raise_if_another_died(self, worker: _Worker) -> None:
        """A ``WorkerDiedError`` for another rank that has died (or dies within a second: a collective with a
        dead peer can fail before its process is reaped)."""
        others = {w.process.sentinel: w for w in self._workers if w is not worker}
        dead = multiprocessing.connection.wait(list(others), _PEER_DEATH_WAIT_S) if others else []
        if dead:
            raise self._died(others[dead[0]])

    def _send(self, message: list[Any], worker: _Worker | None = None) -> None:
        worker = worker or self._workers[0]
        if self._closed:
            raise WorkerDiedError("the executor was shut down")
        try:
            worker.conn.send_bytes(wire.encode(message))
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise self._died(worker) from None

    def _receive(self, worker: _Worker, timeout_s: float | None = None) -> tuple[str, Any]:
        """``worker``'s next message, while watching every worker: one that exits or reports an error (the other
        ranks speak only then) is a ``WorkerDiedError``. Data parallelism: every rank answers its own engine
        (another thread's), so only the other ranks' deaths are watched."""
        others = [w for w in self._workers if w is not worker]
        waits = {worker.conn: worker, worker.process.sentinel: worker}
        if not self._data_parallel:
            waits.update({w.conn: w for w in others})
        waits.update({w.process.sentinel: w for w in others})
        ready = multiprocessing.connection.wait(list(waits), timeout_s)
        if not ready:
            for w in self._workers:
                w.process.kill()
            self._died(worker)
            raise WorkerDiedError(f"{worker.describe()} did not finish a step within {timeout_s:g}s "
                                  "(DSINFER_STEP_TIMEOUT_S) and was killed; the engine cannot go on")
        if worker.conn not in ready:
            source = waits[ready[0]]
            if ready[0] is source.conn and not self._closed:
                failure = self._read(source)
                if failure is not None and failure[0] == "error" and source is not worker:
                    self._kill_all()
                    raise WorkerDiedError(f"{source.describe()} failed: {failure[1]}; the engine cannot go on")
            raise self._died(source)
        message = self._read(worker)
        if message is None:
            raise self._died(worker)
        return message

    def _read(self, worker: _Worker) -> tuple[str, Any] | None:
        try:
            kind, payload = wire.decode(worker.conn.recv_bytes())
        except (EOFError, ConnectionResetError, OSError):
            return None
        return kind, payload

    def _died(self, worker: _Worker) -> WorkerDiedError:
        with self._reaping:  # data-parallel engines' threads may see the same death: one reaps it at a time
            how = worker.exit_status()
            self._kill_all()
        return WorkerDiedError(f"{worker.describe()} died ({how}); the engine cannot go on")

    def _kill_all(self) -> None:
        """The ranks left cannot go on without the one lost (they would wait in its collectives)."""
        self._closed = True
        for w in self._workers:
            if w.process.is_alive():
                w.process.kill()

    def shutdown(self) -> None:
        told = self._workers if self._data_parallel else self._workers[:1]  # rank 0 tells the others, or each
        for worker in told:
            if worker.process.is_alive() and not self._closed:
                try:
                    worker.conn.send_bytes(wire.encode(["shutdown"]))
                except OSError:
                    pass
        self._closed = True
        for w in self._workers:
            w.process.join(timeout=_SHUTDOWN_WAIT_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=_SHUTDOWN_WAIT_S)
            w.conn.close()


class RankExecutor(Executor):
    """One data-parallel rank's executor inside a ``MultiprocExecutor``: its engine's plans go to that rank's
    worker only, and its results come from it (each DP engine steps in a thread of its own, so every rank runs a
    step at once and the MoE layers' collectives meet). The KV cache sizes are the rank's own."""

    bounds_step_time = True

    def __init__(self, parent: MultiprocExecutor, worker: _Worker, info: dict[str, Any]):
        self.parent, self.worker = parent, worker
        self._pending: collections.deque[_StepFuture] = collections.deque()
        _take_worker_facts(self, info)

    @property
    def processes(self) -> list[multiprocessing.Process]:
        return self.parent.processes

    def launch(self, plan: StepPlan) -> _StepFuture:
        return self.parent._launch_on(self.worker, self._pending, plan)

    def shutdown(self) -> None:
        self.parent.shutdown()


def _join(config: EngineConfig, rdv: Rendezvous | None, rank: int) -> tuple[ParallelState, ControlChannel | None]:
    """Pin this rank to its GPU and its CPU cores, then join the other ranks (nothing to join at one rank)."""
    if rdv is None:
        return SINGLE, None
    device = config.device.device
    local_rank = rdv.local_rank(rank)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    if envs.NUMA_BIND.get():
        local_world = rdv.world_size if not rdv.launched else int(envs.launcher_env().get("LOCAL_WORLD_SIZE", 1))
        numa.bind_rank(local_rank, local_world, device.type, visible=envs.cuda_visible_devices())
    return init_parallel_state(rdv, rank, device, envs.DIST_TIMEOUT_S.get(),
                               config.parallel.enable_expert_parallel, config.parallel.data_parallel_size)


def _ready_info(runner: Any, rank: int) -> dict[str, Any]:
    return {"num_kv_blocks": runner.num_blocks, "rank": rank, "pid": os.getpid(),
            "kv_bytes_per_token": runner.kv_bytes_per_token, "num_state_slots": runner.num_state_slots,
            "kv_group_windows": list(runner.kv_group_windows), "num_local_expert_slots": runner.num_local_expert_slots,
            "step_latency_points": [[t, s] for t, s in runner.step_latency_points.items()],
            "decode_padding": [runner.decode_padding.max_seqs, runner.decode_padding.max_query_len]}


def run_worker(config: EngineConfig, conn: multiprocessing.connection.Connection | None, rank: int,
               num_threads: int, rdv: Rendezvous | None = None) -> None:
    """A worker process's main loop (the spawn target; ``conn`` None: a launched rank other than 0): load the
    model, then serve step plans until told to stop or until the engine's end of the pipe closes."""
    from dsinfer.runner.model_runner import ModelRunner

    torch.set_num_threads(num_threads)
    try:
        faults = FaultInjector.from_env(in_worker=True)
        parallel, control = _join(config, rdv, rank)
        runner = ModelRunner(config, parallel)
    except BaseException:  # noqa: BLE001 - the engine must learn why its worker could not start
        _report(conn, traceback.format_exc())
        sys.exit(1)
    if conn is not None:
        conn.send_bytes(wire.encode(["ready", _ready_info(runner, rank)]))
    # the worker's own objects live as long as it does: its collections walk only what steps make
    gc.collect()
    gc.freeze()
    data_parallel = config.parallel.data_parallel_size > 1  # each rank its own plans, over its own pipe
    try:
        _serve(runner, faults, conn if rank == 0 or data_parallel else None, None if data_parallel else control)
    except BaseException:  # noqa: BLE001 - a rank other than 0 failed: it cannot go on, the engine must know
        _report(conn, traceback.format_exc())
        sys.exit(1)
    finally:
        runner.close()
        destroy()


def run_launched_rank(config: EngineConfig) -> int:
    """The main of a launched process whose RANK is not 0 (torchrun, SLURM): join rank 0's engine and follow it
    until it shuts down; -> the exit code."""
    rdv = Rendezvous.resolve(config.parallel.world_size)
    if not rdv.launched or rdv.launched_rank == 0:
        raise ValueError("run_launched_rank is for a launched job's ranks other than 0 (RANK >= 1)")
    logger.info("rank %d of %d: following the engine of rank 0 at %s:%d", rdv.launched_rank, rdv.world_size,
                rdv.master_addr, rdv.master_port)
    try:
        run_worker(config, None, rdv.launched_rank, torch.get_num_threads(), rdv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _report(conn: multiprocessing.connection.Connection | None, text: str) -> None:
    if conn is None:
        logger.error("this rank failed:\n%s", text)
        return
    try:
        conn.send_bytes(wire.encode(["error", text]))
    except OSError:
        pass


def _serve(runner: Any, faults: FaultInjector, conn: multiprocessing.connection.Connection | None,
           control: ControlChannel | None) -> None:
    """Run messages until "shutdown": rank 0 (``conn``) reads them from the engine and passes each on over
    ``control``; the other ranks read them from ``control``."""
    launched: collections.deque[Any] = collections.deque()  # step handles, or the exception a launch raised
    while True:
        data = _next_message(conn, control)
        if data is None:
            return  # the engine is gone
        message = wire.decode(data)
        kind = message[0]
        if kind == "step":
            try:
                if conn is not None:  # injected faults strike rank 0 (a test kills another rank by its pid)
                    faults.before_step()
                launched.append(runner.launch(message[1]))
            except Exception:  # noqa: BLE001 - reported with this step's result
                if conn is None:
                    raise
                launched.append(traceback.format_exc())
        elif kind == "result":
            handle = launched.popleft()
            if conn is None:
                handle.result()  # the other ranks run what rank 0's result runs (MTP drafts), and answer nothing
                continue
            try:
                reply = ["error", handle] if isinstance(handle, str) else ["output", handle.result()]
            except Exception:  # noqa: BLE001
                reply = ["error", traceback.format_exc()]
            conn.send_bytes(wire.encode(reply))
        elif kind == "shutdown":
            return


def _next_message(conn: multiprocessing.connection.Connection | None, control: ControlChannel | None) -> bytes | None:
    """Rank 0: the engine's next message (pinging the other ranks while it is idle), passed on to them; the other
    ranks: rank 0's. None: the engine's pipe closed (the other ranks are told to shut down)."""
    if conn is None:
        return control.receive()
    while control is not None and not conn.poll(PING_S):
        control.broadcast(wire.encode(["ping"]))
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        data = None
    if control is not None:
        control.broadcast(data if data is not None else wire.encode(["shutdown"]))
    return data
