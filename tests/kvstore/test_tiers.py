"""The store's pieces without an engine: entry files, the host and directory tiers, GC, the write-behind queue."""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsinfer.config import KVStoreConfig
from dsinfer.kvstore import gc
from dsinfer.kvstore.counters import Counters
from dsinfer.kvstore.directory import DirectoryTier
from dsinfer.kvstore.entry import EntryError, read_entry, write_entry
from dsinfer.kvstore.host import HostTier
from dsinfer.kvstore.keys import grain_keys
from dsinfer.kvstore.store import KVStore

FP, OTHER_FP = b"f" * 16, b"o" * 16
LAYOUT = "0:[2, 4, 8]"


def payload(seed: int, n: int = 4096) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def entry_bytes(data: np.ndarray, fp: bytes = FP, ttl_s: float = 100.0) -> bytes:
    buf = io.BytesIO()
    write_entry(buf, fp, LAYOUT, 32, ttl_s, data)
    return buf.getvalue()


def test_entry_round_trips_and_names_what_is_wrong():
    data = payload(0)
    raw = entry_bytes(data)
    got, ttl = read_entry(io.BytesIO(raw), FP, LAYOUT, 32)
    assert np.array_equal(got, data) and ttl == 100.0
    flipped = bytearray(raw)
    flipped[-7] ^= 1
    cases = {"truncated": raw[:-10], "foreign": entry_bytes(data, OTHER_FP), "corrupt": bytes(flipped)}
    for reason, bad in cases.items():
        with pytest.raises(EntryError) as info:
            read_entry(io.BytesIO(bad), FP, LAYOUT, 32)
        assert info.value.reason == reason
    with pytest.raises(EntryError, match="layout"):
        read_entry(io.BytesIO(raw), FP, "0:[2, 4, 9]", 32)


def test_grain_keys_chain_and_fingerprint():
    hashes = [bytes([i]) * 16 for i in range(9)]
    keys = grain_keys(hashes, 4, FP)
    assert len(keys) == 2 and keys[0] != keys[1]
    assert grain_keys(hashes, 4, FP, start=1) == keys[1:]
    assert grain_keys(hashes, 4, OTHER_FP)[0] != keys[0]
    assert grain_keys(hashes[:4] + [b"x" * 16] + hashes[5:], 4, FP)[0] == keys[0]  # a grain's key: its last block


def test_host_tier_lru_between_watermarks_and_ttl():
    counters = Counters()
    tier = HostTier(10_000, counters, high=0.9, low=0.5)
    for i in range(4):
        assert tier.put(bytes([i]), torch.zeros(2000, dtype=torch.uint8), 100.0, now=0.0)
    assert tier.get(bytes([0]), now=1.0) is not None  # 0 becomes the most recently used
    tier.put(bytes([4]), torch.zeros(2000, dtype=torch.uint8), 100.0, now=2.0)  # 10,000 > 9,000: down to 5,000
    assert [k for k in map(bytes, ([0], [1], [2], [3], [4])) if k in tier] == [bytes([0]), bytes([4])]
    assert counters.snapshot()["evictions_host"] == 3
    assert tier.get(bytes([0]), now=200.0) is None and counters.snapshot()["expiries"] == 1
    assert not tier.put(b"big", torch.zeros(9500, dtype=torch.uint8), 100.0)
    events = tier.take_events()
    assert events[:4] == [(bytes([i]), True) for i in range(4)] and (bytes([0]), False) == events[-1]


def test_directory_tier_bad_files_are_removed_misses(tmp_path):
    counters = Counters()
    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, counters)
    data = payload(1)
    assert tier.write(b"k" * 16, data, 100.0)
    found = tier.read(b"k" * 16)
    assert found is not None and np.array_equal(found[0], data)
    assert tier.contains(b"k" * 16)
    path = tier.path(b"k" * 16)
    damages = [lambda raw: raw[:50], lambda raw: b"garbage" * 20, lambda raw: raw[:-1] + bytes([raw[-1] ^ 0xFF]),
               lambda raw: entry_bytes(data, OTHER_FP)]
    for i, damage in enumerate(damages):
        tier.write(b"k" * 16, data, 100.0)
        path.write_bytes(damage(path.read_bytes()))
        assert tier.read(b"k" * 16) is None
        assert not path.exists() and counters.snapshot()["corrupt_files"] == i + 1
    assert tier.read(b"absent" * 3) is None and counters.snapshot()["corrupt_files"] == 4


def test_directory_ttl_counts_from_last_use(tmp_path):
    counters = Counters()
    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, counters)
    tier.write(b"a" * 16, payload(2), 50.0)
    path = tier.path(b"a" * 16)
    os.utime(path, (time.time() - 60, time.time() - 60))
    assert not tier.contains(b"a" * 16)
    assert tier.read(b"a" * 16) is None and not path.exists()
    assert counters.snapshot()["expiries"] == 1


def test_concurrent_writers_of_one_key_leave_one_whole_file(tmp_path):
    tiers = [DirectoryTier(tmp_path, FP, LAYOUT, 32, Counters()) for _ in range(4)]
    data = payload(3, 1 << 18)
    barrier = threading.Barrier(4)

    def write(tier: DirectoryTier) -> None:
        barrier.wait()
        for _ in range(5):
            tier.path(b"s" * 16).unlink(missing_ok=True)  # a writer racing a delete as well
            tier.write(b"s" * 16, data, 100.0)

    threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = tiers[0].read(b"s" * 16)
    assert found is not None and np.array_equal(found[0], data)
    assert [p.name for p in tiers[0].path(b"s" * 16).parent.iterdir()] == [tiers[0].path(b"s" * 16).name]


def test_full_disk_and_tiny_budget_drop_saves(tmp_path, monkeypatch):
    counters = Counters()
    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, counters, capacity_bytes=1000)
    assert not tier.write(b"b" * 16, payload(4), 100.0)  # 4 KiB into 1,000 bytes
    roomy = DirectoryTier(tmp_path, FP, LAYOUT, 32, counters)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert not roomy.write(b"c" * 16, payload(5), 100.0)
    assert counters.snapshot()["save_errors"] == 2
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # no temporary file left behind


def test_directory_budget_evicts_least_recently_used(tmp_path):
    counters = Counters()
    size = len(entry_bytes(payload(0)))
    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, counters, capacity_bytes=int(size * 3.5), high=0.95, low=0.6)
    for i in range(3):
        tier.write(bytes([i]) * 16, payload(i), 1000.0)
        os.utime(tier.path(bytes([i]) * 16), (1000 + i, time.time() - 100 + i))
    assert tier.write(b"\x09" * 16, payload(9), 100.0)  # 4 entries > 3.3: the two oldest go
    assert [tier.contains(bytes([i]) * 16) for i in range(3)] == [False, False, True]
    assert counters.snapshot()["evictions_dir"] == 2


def test_gc_removes_expired_invalid_and_stale_temporary_files(tmp_path):
    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, Counters())
    tier.write(b"l" * 16, payload(6), 1000.0)
    tier.write(b"e" * 16, payload(7), 10.0)
    old = time.time() - 100
    os.utime(tier.path(b"e" * 16), (old, old))
    bad = tier.path(b"g" * 16)
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(b"not an entry")
    stale = tmp_path / "x.kv.tmp.1.2.3"
    stale.write_bytes(b"half")
    os.utime(stale, (old - 1000, old - 1000))
    report = gc.collect(tmp_path)
    assert (report.entries, report.expired, report.corrupt, report.temp_removed) == (1, 1, 1, 1)
    assert tier.contains(b"l" * 16) and not stale.exists()


def test_store_promotes_directory_hits_and_drops_saves_when_the_queue_is_full(tmp_path):
    config = KVStoreConfig(host_gb=1e-3, dir=tmp_path, grain=32)
    store = KVStore(config, FP, LAYOUT)
    data = torch.from_numpy(payload(8))
    assert store.save(b"p" * 16, data, 100.0)
    store.flush()
    store.host.discard(b"p" * 16)
    store.load("r", [b"p" * 16, b"q" * 16])
    [(load_id, payloads)] = store.finished_loads(5.0)
    assert load_id == "r" and len(payloads) == 1 and torch.equal(payloads[0], data)
    assert b"p" * 16 in store.host  # promoted
    gate = threading.Event()
    blocked = KVStore(KVStoreConfig(host_gb=1e-3, grain=32, save_queue=2), FP, LAYOUT)
    results = [blocked.save(bytes([i]) * 16, data, 100.0, ready=gate.wait) for i in range(5)]
    gate.set()
    blocked.flush()
    assert results.count(False) == blocked.counters.snapshot()["queue_drops"] >= 2
    store.close()
    blocked.close()


def test_gc_cli(tmp_path, capsys):
    from dsinfer.entrypoints.cli import main

    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, Counters())
    for i in range(3):
        tier.write(bytes([i]) * 16, payload(i), 100.0)
    assert main(["kvstore", "gc", str(tmp_path), "--max-gb", str(len(entry_bytes(payload(0))) * 1.5 / (1 << 30))]) == 0
    out = capsys.readouterr().out
    assert "evicted 2" in out and sum(tier.contains(bytes([i]) * 16) for i in range(3)) == 1
    assert main(["kvstore", "gc", str(Path(tmp_path) / "missing")]) == 2


def test_a_file_deleted_under_its_reader_is_still_read_whole(tmp_path, monkeypatch):
    import dsinfer.kvstore.directory as directory

    tier = DirectoryTier(tmp_path, FP, LAYOUT, 32, Counters())
    data = payload(11)
    tier.write(b"d" * 16, data, 100.0)
    real = directory.read_entry

    def delete_then_read(f, *args):  # another engine's GC removes the file once this reader has it open
        os.unlink(tier.path(b"d" * 16))
        return real(f, *args)

    monkeypatch.setattr(directory, "read_entry", delete_then_read)
    found = tier.read(b"d" * 16)
    assert found is not None and np.array_equal(found[0], data)
    assert tier.read(b"d" * 16) is None  # and then it is a miss


def test_background_gc_thread_sweeps_expired_entries(tmp_path):
    store = KVStore(KVStoreConfig(host_gb=1e-3, dir=tmp_path, grain=32, gc_interval_s=0.02), FP, LAYOUT)
    store.save(b"h" * 16, torch.from_numpy(payload(12)), 100.0)
    store.flush()
    old = time.time() - 1000
    os.utime(store.dir.path(b"h" * 16), (old, old))
    deadline = time.monotonic() + 5
    while store.dir.path(b"h" * 16).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.dir.path(b"h" * 16).exists() and store.counters.snapshot()["expiries"] >= 1
    store.close()


def test_an_unexpected_error_ends_one_job_not_the_threads(tmp_path, monkeypatch):
    """A load that raises hands back the grains read before it (no request left waiting); a save that raises is
    dropped and counted; both threads keep serving the next jobs."""
    store = KVStore(KVStoreConfig(host_gb=1e-3, dir=tmp_path, grain=32), FP, LAYOUT)
    data = torch.from_numpy(payload(9))
    good, bad, later = b"g" * 16, b"b" * 16, b"l" * 16
    real_read, real_put = store._read, store.host.put

    def read(key):
        if key == bad:
            raise RuntimeError("injected")
        return real_read(key)

    def put(key, value, ttl_s):
        if key == bad:
            raise MemoryError("injected")
        return real_put(key, value, ttl_s)

    monkeypatch.setattr(store, "_read", read)
    monkeypatch.setattr(store.host, "put", put)
    assert store.save(good, data, 100.0) and store.save(bad, data, 100.0) and store.save(later, data, 100.0)
    store.flush()  # returns: the writer outlived the failed save
    assert good in store.host and later in store.host and bad not in store.host
    store.load("r", [good, bad, later])
    [(load_id, payloads)] = store.finished_loads(5.0)
    assert load_id == "r" and len(payloads) == 1 and torch.equal(payloads[0], data)
    store.load("next", [later])
    [(load_id, payloads)] = store.finished_loads(5.0)
    assert load_id == "next" and len(payloads) == 1
    counts = store.counters.snapshot()
    assert counts["save_errors"] == 1 and counts["load_errors"] == 1
    store.close()


def test_loads_are_read_at_once_and_handed_back_as_they_finish(tmp_path, monkeypatch):
    """Two loader threads: a load stuck in its read does not hold up the next one."""
    store = KVStore(KVStoreConfig(host_gb=1e-3, grain=32, load_threads=2), FP, LAYOUT)
    data = torch.from_numpy(payload(10))
    slow, fast = b"s" * 16, b"f" * 16
    assert store.save(slow, data, 100.0) and store.save(fast, data, 100.0)
    store.flush()
    gate, real_read = threading.Event(), store._read

    def read(key):
        if key == slow:
            assert gate.wait(10)
        return real_read(key)

    monkeypatch.setattr(store, "_read", read)
    store.load("slow", [slow])
    store.load("fast", [fast])
    [(first, _)] = store.finished_loads(5.0)
    gate.set()
    [(second, payloads)] = store.finished_loads(5.0)
    assert (first, second) == ("fast", "slow") and torch.equal(payloads[0], data)
    store.close()
