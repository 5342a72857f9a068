"""Faults never cost a token or a request: damaged and vanishing files while requests run, a full disk, TTLs."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from dsinfer import LLM, SamplingParams
from tests.kvstore.conftest import GRAIN, assert_no_leak, make_prompts, run, token_ids


def _damage(path, how: int) -> None:
    raw = path.read_bytes()
    if how == 0:
        path.write_bytes(os.urandom(len(raw)))  # garbage
    elif how == 1:
        path.write_bytes(raw[: len(raw) // 2])  # truncated
    elif how == 2:
        path.unlink()  # deleted (another engine's GC)
    else:
        path.write_bytes(raw[:-100] + bytes(b ^ 0x5A for b in raw[-100:]))  # bit rot: a bad checksum


def test_files_damaged_and_deleted_while_requests_run(tiny_llama_dir, cold, tmp_path, monkeypatch):
    prompts = [p for seed in range(10, 14) for p in make_prompts(seed, n=1)]  # no shared prefix
    writer = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN})
    run(writer, prompts)
    writer.engine.flush_kv_store()
    assert len(list(tmp_path.rglob("*.kv"))) == 12
    # one loader thread: the damage below picks grains by the order they are read
    llm = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN, "load_threads": 1})
    tier = llm.engine.runner.kv_transfer.store.dir
    read, seen = tier.read, []

    def damaging_read(key, now=None):  # the admission lookup found the file whole; it breaks before the load
        if len(seen) % 2 == 1:  # the second grain of each request's load (which then stops there)
            _damage(tier.path(key), len(seen) // 2)
        seen.append(key)
        return read(key, now)

    monkeypatch.setattr(tier, "read", damaging_read)
    out = run(llm, prompts)
    assert token_ids(out) == cold("llama", prompts)
    assert [o.num_cached_tokens for o in out] == [32, 32, 32, 32]  # each kept only its first grain
    stats = llm.engine.kv_store_stats()
    assert stats["corrupt_files"] == 3 and stats["hit_tokens_dir"] == 4 * 32
    assert_no_leak(llm)
    llm.engine.flush_kv_store()  # the recomputed grains were saved again, whole
    assert len(list(tmp_path.rglob("*.kv"))) == 12
    assert all(tier.contains(key) for key in seen)
    out = run(llm, prompts)  # the GPU cache has them now
    assert token_ids(out) == cold("llama", prompts)


def test_a_full_disk_drops_saves_never_requests(tiny_llama_dir, cold, tmp_path, monkeypatch):
    prompts = make_prompts(20, n=2)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    llm = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN})
    assert token_ids(run(llm, prompts)) == cold("llama", prompts)
    llm.engine.flush_kv_store()
    assert llm.engine.kv_store_stats()["save_errors"] == 6 and not list(tmp_path.rglob("*.kv*"))
    monkeypatch.undo()
    tiny = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "dir_gb": 1e-6, "grain": GRAIN})
    assert token_ids(run(tiny, prompts)) == cold("llama", prompts)
    tiny.engine.flush_kv_store()
    assert tiny.engine.kv_store_stats()["save_errors"] == 6 and not list(tmp_path.rglob("*.kv"))


def test_expired_entries_are_misses_by_traffic_class(tiny_llama_dir, cold, tmp_path):
    prompts = make_prompts(30, n=1)
    store = {"dir": str(tmp_path), "grain": GRAIN, "ttl_s": {"agent": 1000, "chat": 5000}}
    llm = LLM(str(tiny_llama_dir), kv_store=store)
    with pytest.raises(ValueError, match="kv_retention='batch' is not a traffic class"):
        run(llm, prompts, kv_retention="batch")
    run(llm, prompts, kv_retention="agent")
    run(llm, make_prompts(31, n=1), SamplingParams(temperature=0.0, max_tokens=6, kv_retention="chat"))
    llm.engine.flush_kv_store()
    past = time.time() - 2000  # unused for 2,000 s: past agent's TTL, within chat's
    for path in tmp_path.rglob("*.kv"):
        os.utime(path, (past, past))
    fresh = LLM(str(tiny_llama_dir), kv_store=store)
    agent, chat = run(fresh, prompts + make_prompts(31, n=1))
    assert [agent.num_cached_tokens, chat.num_cached_tokens] == [0, 96]
    assert token_ids([agent, chat]) == cold("llama", prompts + make_prompts(31, n=1))
    assert fresh.engine.kv_store_stats()["expiries"] >= 1


def test_a_stalled_writer_drops_saves_and_never_holds_up_requests(tiny_llama_dir, cold, tmp_path, monkeypatch):
    prompts = make_prompts(60, n=3)
    llm = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN, "save_queue": 2})
    tier = llm.engine.runner.kv_transfer.store.dir
    gate = threading.Event()
    write = tier.write
    monkeypatch.setattr(tier, "write", lambda *args: gate.wait(30) and write(*args))  # a disk that hangs
    assert token_ids(run(llm, prompts)) == cold("llama", prompts)  # finished while the writer is stuck
    gate.set()
    llm.engine.flush_kv_store()
    stats = llm.engine.kv_store_stats()
    # 9 grain saves in one step: at most 2 queued and 1 in the writer's hands, the rest dropped (and counted)
    assert stats["queue_drops"] >= 6 and 1 <= len(list(tmp_path.rglob("*.kv"))) == 9 - stats["queue_drops"]
