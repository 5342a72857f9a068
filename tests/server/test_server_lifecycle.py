"""Client disconnects abort the request; SIGTERM drains in-flight requests, then the server exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .live_server import start_server, stop_server

LONG = {
    "messages": [{"role": "user", "content": "Tell a long story."}],
    "max_tokens": 400,
    "ignore_eos": True,
}


def test_streaming_client_disconnect_aborts_and_frees_kv(server):
    before = server.gauge("dsinfer_generation_tokens_total")
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={**LONG, "stream": True},
        headers=server.headers(),
        timeout=60,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.await_gauge_at_least("dsinfer_num_requests_running", 1)
    server.wait_idle()
    assert server.alive()
    assert 1 <= server.gauge("dsinfer_generation_tokens_total") - before < 400  # counted, cut short


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}),
    ("/v1/chat/completions", LONG),
])
def test_non_streaming_client_disconnect_aborts(server, path, body):
    """The abort is quiet: no unhandled error in the server log (the cancelled wait used to raise
    InvalidStateError from the route)."""
    logged = server.log.stat().st_size
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=2)
    server.wait_idle()
    r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    with server.log.open() as log:
        log.seek(logged)
        new = log.read()
    assert "Traceback" not in new and "unhandled error" not in new, new[-3000:]


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    live = start_server(tmp_path, "--drain-timeout", "60")
    try:
        chunks: list[str] = []
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
        }

        def stream() -> None:
            with httpx.stream(
                "POST", f"{live.url}/v1/chat/completions", json=body, headers=live.headers(), timeout=120
            ) as r:
                chunks.extend(r.iter_lines())

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        live.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{live.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = live.post("/v1/chat/completions", json={"messages": body["messages"], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        t.join(120)
        assert "data: [DONE]" in chunks  # the in-flight request finished
        assert live.proc.wait(60) == 0
    finally:
        stop_server(live)


def test_drain_timeout_ends_what_is_left_with_a_503_and_exits(tmp_path):
    """SIGTERM with a short --drain-timeout: the stream still running ends with an in-band 503 error, the request
    still queued gets a 503 answer, no traceback, and the process exits soon after the timeout."""
    live = start_server(tmp_path, "--drain-timeout", "1", "--max-num-seqs", "1")
    try:
        chunks: list[str] = []
        queued: list[httpx.Response] = []
        body = {"prompt": "Count:", "max_tokens": 480, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True},
                              headers=live.headers(), timeout=120) as r:
                chunks.extend(r.iter_lines())

        def wait_in_queue() -> None:
            queued.append(httpx.post(f"{live.url}/v1/completions", json=body, headers=live.headers(), timeout=120))

        threads = [threading.Thread(target=stream), threading.Thread(target=wait_in_queue)]
        threads[0].start()
        deadline = time.monotonic() + 60
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        threads[1].start()
        time.sleep(0.5)
        sent = time.monotonic()
        live.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert live.proc.wait(30) == 0
        assert time.monotonic() - sent < 15
        events = [json.loads(line[6:]) for line in chunks if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "service_unavailable_error", events[-1]
        assert "data: [DONE]" not in chunks
        assert queued[0].status_code == 503 and queued[0].json()["error"]["type"] == "service_unavailable_error"
        log = live.log.read_text()
        assert "Traceback" not in log and "cut off" in log, log[-3000:]
    finally:
        stop_server(live)
