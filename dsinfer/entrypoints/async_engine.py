"""AsyncEngine: an LLMEngine stepped in its own thread, with one asyncio stream per request.

The event loop never runs engine work. Submissions and aborts go through lock-protected queues that the engine
thread applies before each step; outputs come back to each request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. An exception escaping the step loop (a dead worker's ``WorkerDiedError``
included) marks the engine dead: every open stream fails with ``EngineCrashedError`` and new requests are refused
with ``EngineDeadError``, both naming what died; the server then exits (``server.lifecycle``). A watchdog thread
does the same when one step runs longer than ``step_timeout_s`` (``DSINFER_STEP_TIMEOUT_S``): a hung step cannot
be interrupted, but its requests are answered and the server exits. Draining refuses
new requests while in-flight ones finish. ``shutdown`` also stops the engine's own workers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from dsinfer.engine.heap import startup_heap_frozen
from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.entrypoints.openmp_pool import release_thread_pool
from dsinfer.entrypoints.step_clock import StepClock, StepTimeoutError

__all__ = ["AsyncEngine", "EngineCrashedError", "EngineDeadError", "EngineDrainingError", "EngineOverloadedError",
           "RequestRejectedError", "StepTimeoutError"]

logger = logging.getLogger("dsinfer.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can be served (a new request's answer: 503)."""


class EngineCrashedError(EngineDeadError):
    """The engine loop crashed while this request was in flight (its answer: 500, as vLLM's)."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; try again later."""


class RequestRejectedError(ValueError):
    """The engine refused the request (bad input found at ``add_request``)."""


@dataclass
class _Submission:
    request_id: str
    prompt: str | dict[str, Any]
    params: SamplingParams
    arrival_time: float  # time.monotonic(), the clock of every request metric
    priority: int = 0
    first_token: int | None = None  # sampled elsewhere (``LLMEngine.add_request``)


def _num_prompt_tokens(prompt: str | dict[str, Any]) -> int:
    """A queued prompt's size for ``max_waiting_tokens``: its token ids, or a text's characters (a bound on its
    tokens for any tokenizer whose tokens are at least one character)."""
    return len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else len(prompt)


class _Stream:
    """Outputs of one request, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """Thread-stepped engine. ``max_waiting`` bounds requests not yet running (beyond it:
    EngineOverloadedError); ``max_waiting_tokens`` (None: no bound) bounds the prompt tokens they still have to
    compute, except that a request finding none queued is always taken (a long prompt is never refused forever).
    ``step_timeout_s``: the watchdog's bound on one step (None: DSINFER_STEP_TIMEOUT_S).
    """

    def __init__(self, engine: Any, max_waiting: int = 256, idle_wait_s: float = 0.5,
                 step_timeout_s: float | None = None, max_waiting_tokens: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_waiting = max_waiting
        self.max_waiting_tokens = max_waiting_tokens
        self._in_transit_tokens = 0  # prompt tokens handed to the engine that its last stats do not count yet
        self._idle_wait_s = idle_wait_s
        self._clock = StepClock(step_timeout_s)
        self.step_timeout_s = self._clock.timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._submissions: list[_Submission] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._in_engine: set[str] = set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.draining = False
        self.stats: dict[str, Any] = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}

    # ---- lifecycle ----------
    def start(self) -> None:
        """Start the engine thread; the calling one (which built the engine) gives up its OpenMP pool for it
        (``openmp_pool``: with two, torch's CPU kernels run slower in the engine thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsinfer-engine", daemon=True)
            release_thread_pool()
            self._thread.start()
            threading.Thread(target=self._watch, name="dsinfer-watchdog", daemon=True).start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the step loop (waiting up to ``timeout`` for the step in progress), then the engine's workers
        (``engine.shutdown()``, where it has one): a thread still stuck in a step then gets its worker's death."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:  # a dead engine's thread may be stuck in a hung step: no wait for it
            self._thread.join(0.1 if self.error is not None else timeout)
        stop_workers = getattr(self.engine, "shutdown", None)
        if stop_workers is not None:
            try:
                stop_workers()
            except Exception:  # noqa: BLE001 - shutting down anyway; say why it was not clean
                logger.exception("the engine's shutdown failed")

    @property
    def dead(self) -> bool:
        thread_gone = self._thread is not None and not self._thread.is_alive() and not self._stop
        return self.error is not None or thread_gone

    @property
    def death_reason(self) -> str:
        """What killed the engine, for error messages and logs ("" while it lives)."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return "the engine thread exited" if self.dead else ""

    @property
    def is_healthy(self) -> bool:
        return not self.dead and not self.draining

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait until no request is in flight (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while self._streams and not self.dead:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def cut_off(self) -> int:
        """Fail every request still in flight with ``EngineDrainingError`` (a drain that timed out): each one's
        handler answers 503 (in-band for a started stream) and the engine aborts it. Returns how many."""
        with self._lock:
            cut, self._streams = self._streams, {}
            self._aborts.extend(rid for rid in cut if rid not in self._aborts)
        self._wake.set()
        for stream in cut.values():
            stream.put(EngineDrainingError("the server shut down before this request finished"))
        return len(cut)

    # ---- requests ----------
    def _check_accepting(self, prompt: str | dict[str, Any]) -> None:
        if self.dead:
            raise EngineDeadError(f"the engine is dead ({self.death_reason})")
        if self.draining:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        waiting = len(self._submissions) + int(self.stats.get("num_waiting", 0))
        if waiting >= self.max_waiting:
            raise EngineOverloadedError(f"{waiting} requests are already waiting (limit {self.max_waiting})")
        if self.max_waiting_tokens is not None:
            queued = sum(_num_prompt_tokens(sub.prompt) for sub in self._submissions)
            queued += self._in_transit_tokens + int(self.stats.get("num_waiting_tokens", 0))
            if queued and queued + _num_prompt_tokens(prompt) > self.max_waiting_tokens:
                raise EngineOverloadedError(
                    f"{queued} prompt tokens are already waiting; this request's {_num_prompt_tokens(prompt)} "
                    f"would pass the limit of {self.max_waiting_tokens} (--max-waiting-tokens)")

    def wait_kv_saves(self) -> bool:
        """Blocking (call it from a thread): the engine's queued KV store saves written (``LLMEngine.wait_kv_saves``);
        False when it cannot wait (no store in this process)."""
        wait = getattr(self.engine, "wait_kv_saves", None)
        return bool(wait()) if wait is not None else False

    def check_priority(self, priority: int) -> None:
        """A ValueError unless the engine takes ``priority`` (``LLMEngine.check_priority``)."""
        self.engine.check_priority(priority)

    async def generate(
        self, prompt: str | dict[str, Any], params: SamplingParams, request_id: str, priority: int = 0,
        first_token: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine makes them; aborts the request if the consumer stops early.
        ``priority``, ``first_token``: see ``LLMEngine.add_request``."""
        self._check_accepting(prompt)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self.error is not None:  # it died after the check: _die has already failed the open streams
                raise EngineDeadError(f"the engine is dead ({self.death_reason})")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._submissions.append(_Submission(request_id, prompt, params, time.monotonic(), priority,
                                                  first_token))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is None:
                return
            self._aborts.append(request_id)
        self._wake.set()

    # ---- engine thread ----------
    def _run(self) -> None:
        try:
            with startup_heap_frozen():
                while not self._stop and self.error is None:
                    self._wake.clear()
                    self._apply_queued()
                    if not self.engine.has_unfinished_requests():
                        self._refresh_stats()
                        self._wake.wait(self._idle_wait_s)
                        continue
                    self._clock.begin()
                    outputs = self.engine.step()
                    self._clock.end()
                    self._dispatch(outputs)
                    self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - any escape kills the engine; streams must learn it
            self._die(exc)

    def _apply_queued(self) -> None:
        with self._lock:
            submissions, self._submissions = self._submissions, []
            if self.max_waiting_tokens is not None:
                self._in_transit_tokens += sum(_num_prompt_tokens(sub.prompt) for sub in submissions)
            aborts, self._aborts = self._aborts, []
        to_abort = [rid for rid in aborts if rid in self._in_engine]
        if to_abort:
            self.engine.abort_request(to_abort)
            self._in_engine.difference_update(to_abort)
        for sub in submissions:
            stream = self._streams.get(sub.request_id)
            if stream is None:  # aborted before it reached the engine
                continue
            try:
                extra = {} if sub.first_token is None else {"first_token": sub.first_token}
                self.engine.add_request(sub.request_id, sub.prompt, sub.params, arrival_time=sub.arrival_time,
                                        priority=sub.priority, **extra)
            except (ValueError, TypeError) as exc:
                with self._lock:
                    self._streams.pop(sub.request_id, None)
                stream.put(RequestRejectedError(str(exc)))
                continue
            self._in_engine.add(sub.request_id)

    def _dispatch(self, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if out.finished:
                self._in_engine.discard(out.request_id)
            if stream is not None:
                stream.put(out)

    def _refresh_stats(self) -> None:
        """New engine stats; the prompt tokens handed to the engine since the last ones are in them now (counted
        twice for a moment rather than not at all, so the bound never lets one through)."""
        self.stats = self.engine.get_stats()
        self._in_transit_tokens = 0

    def _watch(self) -> None:
        """The step watchdog: a step running past ``step_timeout_s`` kills the engine (its thread stays stuck)."""
        while not self._stop and self.error is None:
            overdue = self._clock.overdue()
            if overdue is not None:
                self._die(overdue)
                return
            time.sleep(self._clock.poll_s)

    def _die(self, exc: BaseException) -> None:
        with self._lock:  # under the lock: a request that generate() adds after this sees the error
            if self.error is not None:  # the watchdog got here first; the stuck step has since raised too
                return
            self.error = exc
            streams, self._streams = list(self._streams.values()), {}
        logger.error("engine loop crashed; failing every open request", exc_info=exc)
        for stream in streams:
            stream.put(EngineCrashedError(f"the engine died while serving this request ({self.death_reason})"))
