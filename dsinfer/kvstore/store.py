"""The worker's KVStore: the host and directory tiers behind a write-behind queue and a loader thread.

- ``save(key, payload, ttl_s, ready)`` queues one grain (its payload already gathered from the KV blocks into
  host memory, or on its way there: ``ready`` waits for that copy); the writer thread puts it in the host tier and
  writes its file. The queue is bounded: when it is full the save is dropped and counted (a save never makes a
  step wait);
- ``load(load_id, keys)`` queues the read of a run of grains; a loader thread (``load_threads`` of them read
  different loads at once) takes each from the host tier,
  else from the directory (then also keeps it in the host tier: promotion), and stops at the first miss;
  a sliding-window model's window state is read last, only when every grain was found;
  ``finished_loads`` hands back (load_id, payloads of the grains found, in order);
- a GC thread sweeps both tiers every ``gc_interval_s`` (expired entries, the directory's watermark).
An unexpected error in a save or a load is logged and counted (``save_errors`` / ``load_errors``) and ends only
that job: a failed load hands back the grains read before it (the rest are recomputed), so a request waiting on it
is never left waiting, and the threads keep serving the others.
Payloads are flat uint8 tensors (``runner.kv_transfer`` knows the layer layout inside).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsinfer.config import KVStoreConfig
from dsinfer.kvstore.counters import Counters
from dsinfer.kvstore.directory import DirectoryTier
from dsinfer.kvstore.host import HostTier

GiB = 1 << 30
logger = logging.getLogger(__name__)


class KVStore:
    def __init__(self, config: KVStoreConfig, fingerprint: bytes, layout: str, pin: bool = False):
        """``layout``: the payload's layer layout (checked in every file read); ``pin``: host payloads in pinned
        memory (CUDA)."""
        self.config = config
        self.counters = Counters()
        self.host = (HostTier(int(config.host_gb * GiB), self.counters, config.high_watermark,
                              config.low_watermark, pin) if config.host_gb > 0 else None)
        self.dir = None
        if config.dir is not None:
            capacity = None if config.dir_gb is None else int(config.dir_gb * GiB)
            self.dir = DirectoryTier(Path(config.dir), fingerprint, layout, config.grain, self.counters, capacity,
                                     config.high_watermark, config.low_watermark)
        self._saves: queue.Queue = queue.Queue(maxsize=config.save_queue)
        self._loads: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        loaders = [(f"loader-{i}", self._load_loop) for i in range(config.load_threads)]
        self._threads = [threading.Thread(target=fn, name=f"dsinfer-kvstore-{name}", daemon=True)
                         for name, fn in (("writer", self._write_loop), *loaders, ("gc", self._gc_loop))]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)  # an offline script's last saves are written before the process ends

    # ----------------------------------------------------------------- saves
    def save(self, key: bytes, payload: torch.Tensor, ttl_s: float, ready: Callable[[], None] | None = None) -> bool:
        """Queue one grain's save; False (and counted) when the queue is full."""
        try:
            self._saves.put_nowait((key, payload, ttl_s, ready))
            return True
        except queue.Full:
            self.counters.add("queue_drops")
            return False

    def has_room(self) -> bool:
        """Whether a save would be queued now; False counts it as dropped (the caller then skips the gather)."""
        if self._saves.full():
            self.counters.add("queue_drops")
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued save is written (tests, benchmarks, shutdown)."""
        self._saves.join()

    def _write_loop(self) -> None:
        while True:
            job = self._saves.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception:  # noqa: BLE001 - one failed save is dropped; the writer serves the next ones
                self.counters.add("save_errors")
                logger.exception("a KV store save failed and was dropped")
            finally:
                self._saves.task_done()

    def _write(self, key: bytes, payload: torch.Tensor, ttl_s: float, ready: Callable[[], None] | None) -> None:
        if ready is not None:
            ready()
        if self.host is not None:
            self.host.put(key, payload, ttl_s)
        if self.dir is not None:
            self.dir.write(key, payload.numpy(), ttl_s)
        self.counters.add("bytes_saved", payload.numel())

    # ----------------------------------------------------------------- loads
    def load(self, load_id: str, keys: list[bytes], window_key: bytes | None = None, window_tokens: int = 0) -> None:
        """Read ``keys`` in order (stopping at the first miss), then ``window_key`` when every one was found; the
        window entry's hit counts ``window_tokens`` tokens (a grain's counts ``grain``)."""
        self._loads.put((load_id, keys, window_key, window_tokens, time.monotonic()))

    def finished_loads(self, timeout_s: float = 0.0) -> list[tuple[str, list[torch.Tensor]]]:
        """Loads read since the last call (waiting up to ``timeout_s`` for a first one)."""
        out = []
        try:
            out.append(self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is None:
                return
            load_id, keys, window_key, window_tokens, start = job
            payloads = []
            reads = [(key, self.config.grain) for key in keys] + ([(window_key, window_tokens)] if window_key else [])
            try:
                for key, tokens in reads:
                    found = self._read(key)
                    if found is None:
                        break
                    payloads.append(found[0])
                    self.counters.add(f"hit_tokens_{found[1]}", tokens)
            except Exception:  # noqa: BLE001 - the grains read so far stand; the request recomputes the rest
                self.counters.add("load_errors")
                logger.exception("a KV store load failed after %d of %d grains", len(payloads), len(reads))
            self.counters.add("loads")
            self.counters.add("load_seconds", time.monotonic() - start)
            self.counters.add("bytes_loaded", sum(p.numel() for p in payloads))
            self._done.put((load_id, payloads))

    def _read(self, key: bytes) -> tuple[torch.Tensor, str] | None:
        """(payload, the tier it came from: host | dir), or None for a miss."""
        payload = self.host.get(key) if self.host is not None else None
        if payload is not None:
            return payload, "host"
        if self.dir is None:
            return None
        found = self.dir.read(key)
        if found is None:
            return None
        payload = torch.from_numpy(found[0])
        if self.host is not None:  # promotion: the next hit comes from host memory
            self.host.put(key, payload, found[1])
        return payload, "dir"

    # ----------------------------------------------------------------- upkeep
    def _gc_loop(self) -> None:
        while not self._stop.wait(self.config.gc_interval_s):
            if self.host is not None:
                self.host.sweep()
            if self.dir is not None:
                self.dir.collect()

    def host_events(self) -> list[tuple[bytes, bool]]:
        return self.host.take_events() if self.host is not None else []

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.close)
        self._saves.put(None)
        for _ in range(self.config.load_threads):
            self._loads.put(None)
        for thread in self._threads:
            thread.join(timeout=30)
