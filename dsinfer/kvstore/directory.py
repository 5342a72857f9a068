"""The directory tier: one file per grain under ``<dir>/<model fingerprint>/<key[:2]>/<key>.kv``.

The directory may be local disk or a shared POSIX file system (3FS, NFS, CephFS, Lustre) that several engines
use at once: a writer writes a temporary file of its own (``<key>.kv.tmp.<pid>.<thread>.<n>``) and renames it
into place, so a reader never sees a half-written file under a real name and two writers of one key both leave a
whole file (the last rename wins; both hold the same KV). A reader opens the file once and reads it through, so a
delete under it (another engine's GC) either happens before (a miss) or does not disturb it. A file that fails
its checks (``entry.read_entry``) is a miss; it is removed (when it is still the file that was read) and counted.

Size: ``capacity_bytes`` (None: only the file system's space) bounds the entries; the tier counts its own writes
and runs ``gc.collect`` when they pass the high watermark (the background thread re-counts everyone's). A write
the file system refuses (full, over quota) is dropped and counted, never raised.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import numpy as np

from dsinfer.kvstore import gc
from dsinfer.kvstore.counters import Counters
from dsinfer.kvstore.entry import EntryError, read_entry, read_meta, write_entry


def entry_path(model_dir: Path, key: bytes) -> Path:
    name = key.hex()
    return model_dir / name[:2] / (name + gc.ENTRY_SUFFIX)


def is_stored(model_dir: Path, key: bytes, fingerprint: bytes, now: float) -> bool | None:
    """Whether ``key`` has a live entry (metadata only: a stat and the header); None: one that expired."""
    path = entry_path(model_dir, key)
    try:
        mtime = path.stat().st_mtime
        with path.open("rb") as f:
            ttl_s = read_meta(f, fingerprint)
    except (OSError, EntryError):
        return False
    return True if now - mtime <= ttl_s else None


class DirectoryTier:
    def __init__(self, root: Path, fingerprint: bytes, layout: str, num_tokens: int, counters: Counters,
                 capacity_bytes: int | None = None, high: float = 0.95, low: float = 0.85):
        self.root = Path(root)
        self.model_dir = self.root / fingerprint.hex()
        self.fingerprint, self.layout, self.num_tokens = fingerprint, layout, num_tokens
        self.counters = counters
        self.capacity, self.high, self.low = capacity_bytes, high, low
        self._tmp_ids = itertools.count()
        self._lock = threading.Lock()
        self.model_dir.mkdir(parents=True, exist_ok=True)
        self.used = self.collect().bytes if capacity_bytes is not None else 0

    def path(self, key: bytes) -> Path:
        return entry_path(self.model_dir, key)

    def contains(self, key: bytes, now: float | None = None) -> bool:
        return bool(is_stored(self.model_dir, key, self.fingerprint, time.time() if now is None else now))

    def read(self, key: bytes, now: float | None = None) -> tuple[np.ndarray, float] | None:
        """(payload (uint8), TTL) of ``key``, or None: absent, expired, or invalid (then removed and counted)."""
        now = time.time() if now is None else now
        path = self.path(key)
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                try:
                    payload, ttl_s = read_entry(f, self.fingerprint, self.layout, self.num_tokens)
                except EntryError:
                    self._remove_if_same(path, st.st_ino)
                    self.counters.add("corrupt_files")
                    return None
        except OSError:  # absent, or removed under us
            return None
        if now - st.st_mtime > ttl_s:
            self._remove_if_same(path, st.st_ino)
            self.counters.add("expiries")
            return None
        try:
            os.utime(path)  # last use: LRU and TTL count from here
        except OSError:
            pass
        return payload, ttl_s

    def write(self, key: bytes, payload: np.ndarray, ttl_s: float) -> bool:
        """Store ``payload``; False when dropped (over the budget even after a sweep, or the file system refused).
        A key already stored is only touched (another engine, or an earlier save, wrote the same KV)."""
        path = self.path(key)
        if path.exists():
            try:
                os.utime(path)
                return True
            except OSError:
                pass
        size = payload.nbytes
        if self.capacity is not None and not self._room_for(size):
            self.counters.add("save_errors")
            return False
        tmp = path.with_name(f"{path.name}{gc.TMP_MARK}{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}")
        try:
            path.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as f:
                written = write_entry(f, self.fingerprint, self.layout, self.num_tokens, ttl_s, payload)
            os.replace(tmp, path)
        except OSError:  # ENOSPC, EDQUOT, a vanished directory: drop the save, never the request
            tmp.unlink(missing_ok=True)
            self.counters.add("save_errors")
            return False
        with self._lock:
            self.used += written
        return True

    def collect(self, now: float | None = None, reserve: int = 0) -> gc.GCReport:
        """One sweep of the whole directory (every model's entries share the budget; ``reserve``: bytes about to
        be written)."""
        report = gc.collect(self.root, self.capacity, self.high, self.low, now, self.counters, reserve=reserve)
        with self._lock:
            self.used = report.bytes
        return report

    def _room_for(self, size: int) -> bool:
        if size > self.high * self.capacity:
            return False
        if self.used + size > self.high * self.capacity:
            self.collect(reserve=size)
        return self.used + size <= self.high * self.capacity

    @staticmethod
    def _remove_if_same(path: Path, inode: int) -> None:
        """Remove ``path`` if it is still the file read (not a whole one another writer renamed there since)."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
