"""Garbage collection of a store directory: expired entries, then LRU (oldest mtime first) under a watermark.

An entry's mtime is its last use (a hit touches it), its header's TTL how long it may go unused. ``collect``
walks every model's entries under the directory (it needs no model: the background thread of each engine and
``dsinfer kvstore gc DIR`` run the same sweep); files that are not entries, and temporary files older than
``tmp_age_s`` (a writer that died mid-write), are removed too. Safe beside running engines: a file removed under
a reader is a miss for it, and writers rename whole files into place.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from dsinfer.kvstore.counters import Counters
from dsinfer.kvstore.entry import EntryError, read_meta

ENTRY_SUFFIX = ".kv"
TMP_MARK = ".tmp."


@dataclass
class GCReport:
    entries: int = 0  # entries found
    bytes: int = 0  # their bytes, after the sweep
    expired: int = 0
    evicted: int = 0
    corrupt: int = 0
    temp_removed: int = 0


def collect(root: Path, capacity_bytes: int | None = None, high: float = 0.95, low: float = 0.85,
            now: float | None = None, counters: Counters | None = None, tmp_age_s: float = 600.0,
            reserve: int = 0) -> GCReport:
    """Sweep ``root``: drop expired and invalid entries and stale temporary files, then, when the entries (and
    ``reserve`` bytes about to be written) take more than ``high`` x ``capacity_bytes``, the least recently used
    until at most ``low`` x it remain."""
    now = time.time() if now is None else now
    report = GCReport()
    live: list[tuple[float, int, str]] = []  # mtime, size, path
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if TMP_MARK in name:
                if now - st.st_mtime > tmp_age_s and _remove(path):
                    report.temp_removed += 1
                continue
            if not name.endswith(ENTRY_SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    ttl_s = read_meta(f, None)
            except FileNotFoundError:
                continue
            except (EntryError, OSError):
                report.corrupt += _remove(path)
                continue
            if now - st.st_mtime > ttl_s:
                report.expired += _remove(path)
                continue
            live.append((st.st_mtime, st.st_size, path))
    used = sum(size for _, size, _ in live)
    if capacity_bytes is not None and used + reserve > high * capacity_bytes:
        live.sort()
        for _, size, path in live:
            if used + reserve <= low * capacity_bytes:
                break
            report.evicted += _remove(path)
            used -= size
    report.entries = len(live) - report.evicted
    report.bytes = used
    if counters is not None:
        counters.add("expiries", report.expired)
        counters.add("evictions_dir", report.evicted)
        counters.add("corrupt_files", report.corrupt)
    return report


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:  # another engine's sweep took it first
        return False
