"""A server started with ``--kv-store``: the ``kv_retention`` body field on the routes, cached prompt tokens in
usage (OpenAI's ``cached_tokens``, Anthropic's ``cache_read_input_tokens``) and the dsinfer_kv_store_* metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from .live_server import start_server, stop_server

SYSTEM = "You are a careful assistant. " * 40  # a long shared prefix: more than one 128-token grain


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_store")
    (tmp / "kv").mkdir()
    store = {"host_gb": 0.05, "dir": str(tmp / "kv"), "ttl_s": {"agent": 259200, "chat": 604800}}
    live = start_server(tmp, "--kv-store", json.dumps(store))
    yield live
    stop_server(live)


def _chat(text: str, **extra) -> dict:
    return {"max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            **extra}


def test_kv_retention_names_a_configured_class(store_server):
    r = store_server.post("/v1/chat/completions", json=_chat("Hi", kv_retention="agent"))
    assert r.status_code == 200, r.text
    r = store_server.post("/v1/chat/completions", json=_chat("Hi", kv_retention="batch"))
    assert r.status_code == 400 and "kv_retention='batch' is not a traffic class" in r.text
    r = store_server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "kv_retention": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_retention"


def test_repeated_prefix_is_reported_as_cached_tokens(store_server):
    store_server.post("/v1/chat/completions", json=_chat("First question", kv_retention="chat"))
    r = store_server.post("/v1/chat/completions", json=_chat("Second question", kv_retention="chat"))
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    body = {"max_tokens": 2, "system": SYSTEM, "messages": [{"role": "user", "content": "Third"}],
            "kv_retention": "chat"}
    store_server.post("/v1/messages", json=body)
    r = store_server.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_read_input_tokens"] >= 128


def test_metrics_export_the_store_counters(store_server):
    store_server.post("/v1/chat/completions", json=_chat("Metrics"))
    text = httpx.get(f"{store_server.url}/metrics", headers=store_server.headers(), timeout=30).text
    for name in ("dsinfer_kv_store_lookups_total", 'dsinfer_kv_store_hit_tokens_total{tier="host"}',
                 'dsinfer_kv_store_evictions_total{tier="dir"}', "dsinfer_kv_store_bytes_saved_total",
                 "dsinfer_kv_store_queue_drops_total", "dsinfer_kv_store_corrupt_files_total",
                 "dsinfer_kv_store_load_seconds_count"):
        assert name in text, name
    saved = next(line for line in text.splitlines() if line.startswith("dsinfer_kv_store_bytes_saved_total"))
    assert float(saved.split()[-1]) > 0
