"""Overload is back-pressure, never failure: a short soak of a live server at twice its capacity (running plus
queued requests), some clients hanging up early, sees only 200s and 429s (with Retry-After), and ends with no
request left running or waiting and the server's RSS within 10% of what it was after a warm-up; the
queued-prompt-token bound answers the same 429."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx

from ..protocol.tiny_tokenizer import write_tiny_tokenizer
from .live_server import API_KEY, start_tiny_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_NUM_SEQS, MAX_WAITING = 2, 2
NUM_CLIENTS = 2 * (MAX_NUM_SEQS + MAX_WAITING)  # twice what the server holds
SOAK_S = 4.0
WARMUP_S = 1.5  # the same load first, so that RSS is measured with the allocator and caches at working size


def _body(rng: random.Random, stream: bool) -> dict:
    return {"model": "tiny", "prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))],
            "max_tokens": rng.randrange(8, 40), "ignore_eos": True, "stream": stream}


def _client(url: str, seed: int, until: float, seen: list, lock: threading.Lock) -> None:
    try:
        _requests(url, seed, until, seen, lock)
    except Exception as exc:  # noqa: BLE001 - a dropped connection or a timeout: counted as the test's failure
        with lock:
            seen.append((repr(exc), None))


def _requests(url: str, seed: int, until: float, seen: list, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(headers=HEADERS, timeout=30) as client:
        while time.monotonic() < until:
            if rng.random() < 0.2:  # a streaming client that hangs up after its first event
                with client.stream("POST", f"{url}/v1/completions", json=_body(rng, True)) as r:
                    status, retry = r.status_code, r.headers.get("retry-after")
                    for line in r.iter_lines():  # a 429's body has no event: it is read whole
                        if line.startswith("data: "):
                            break
            else:
                r = client.post(f"{url}/v1/completions", json=_body(rng, False))
                status, retry = r.status_code, r.headers.get("retry-after")
            with lock:
                seen.append((status, retry))
            if status == 429:
                time.sleep(0.01)


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {name: float(value) for name, value in
            re.findall(r"^dsinfer_(num_requests_(?:running|waiting)) (\S+)$", text, re.M)}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _load(url: str, seconds: float, first_seed: int, seen: list, lock: threading.Lock) -> None:
    until = time.monotonic() + seconds
    clients = [threading.Thread(target=_client, args=(url, first_seed + k, until, seen, lock))
               for k in range(NUM_CLIENTS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(seconds + 30)
    assert not any(t.is_alive() for t in clients), "a client hung"


def test_a_soak_at_twice_capacity_sees_only_200_and_429_and_leaks_no_request(tiny_llama_dir, tmp_path):
    proc, url, log = start_tiny_server(
        tmp_path, tiny_llama_dir, write_tiny_tokenizer(tmp_path / "tok"), "uni",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING))
    try:
        seen: list[tuple[int, str | None]] = []
        lock = threading.Lock()
        _load(url, WARMUP_S, 1000, seen, lock)
        warm_rss = _rss_mib(proc.pid)
        _load(url, SOAK_S, 0, seen, lock)
        statuses = [status for status, _ in seen]
        assert set(statuses) <= {200, 429}, set(statuses)
        assert statuses.count(200) >= 10 and statuses.count(429) >= 1, (statuses.count(200), statuses.count(429))
        assert all(retry == "1" for status, retry in seen if status == 429)
        deadline = time.monotonic() + 2.0  # the early hang-ups were aborted, not left running
        while (gauges := _gauges(url)) != {"num_requests_running": 0.0, "num_requests_waiting": 0.0}:
            assert time.monotonic() < deadline, gauges
            time.sleep(0.05)
        assert proc.poll() is None and httpx.get(f"{url}/health", timeout=5).status_code == 200
        end_rss = _rss_mib(proc.pid)
        assert end_rss <= 1.10 * warm_rss, f"the server's RSS grew from {warm_rss:.0f} to {end_rss:.0f} MiB"
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_queued_prompt_token_bound_answers_429_with_retry_after(tiny_llama_dir, tmp_path):
    proc, url, log = start_tiny_server(
        tmp_path, tiny_llama_dir, write_tiny_tokenizer(tmp_path / "tok"), "uni",
        "--max-num-seqs", "1", "--max-waiting-tokens", "64")
    try:
        body = {"model": "tiny", "prompt": list(range(3, 53)), "max_tokens": 200, "ignore_eos": True}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        refused = [r for r in results if r.status_code == 429]
        assert sorted({r.status_code for r in results}) == [200, 429], [r.status_code for r in results]
        error = refused[0].json()["error"]
        assert refused[0].headers["retry-after"] == "1" and error["type"] == "rate_limit_error"
        assert "would pass the limit of 64 (--max-waiting-tokens)" in error["message"]
    finally:
        proc.terminate()
        proc.wait(30)
