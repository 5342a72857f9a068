"""``dsinfer router`` over live replicas of the bundled model on loopback: three replicas (A without a KV store,
B and C sharing one directory store) started once for the module, a prefix-aware router over A and B and a
P/D router (prefill C, decode B). The tests run in file order: the last two kill replica A and stop the P/D
router."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.live_server import REPO, free_port

SYSTEM = "You are a careful assistant who answers in short sentences. " * 14  # ~170 tokens: one 128-token grain


@dataclass
class Proc:
    url: str
    proc: subprocess.Popen
    log: Path

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", timeout=10).json()


def _start(tmp: Path, name: str, module: str, *args: str) -> Proc:
    port = free_port()
    log = tmp / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSINFER_CPU_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Proc(f"http://127.0.0.1:{port}", proc, log)


def _wait_healthy(procs: list[Proc], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        while True:
            assert p.proc.poll() is None, f"{p.log.name} exited:\n{p.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{p.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{p.log.name} not healthy:\n{p.log.read_text()[-3000:]}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    (tmp / "kv").mkdir()
    store = json.dumps({"dir": str(tmp / "kv"), "host_gb": 0})
    serve = ("--max-model-len", "512", "--log-level", "warning")
    a = _start(tmp, "a", "dsinfer.server", *serve)
    b = _start(tmp, "b", "dsinfer.server", *serve, "--kv-store", store)
    c = _start(tmp, "c", "dsinfer.server", *serve, "--kv-store", store)
    procs = [a, b, c]
    try:
        _wait_healthy(procs)
        fast = ("--health-interval", "0.2", "--eject-after", "1", "--log-level", "warning")
        mixed = _start(tmp, "router", "dsinfer.router", "--replica", a.url, b.url, "--min-prefix-tokens", "64",
                       *fast)
        pd = _start(tmp, "router-pd", "dsinfer.router", "--prefill", c.url, "--decode", b.url, *fast)
        procs += [mixed, pd]
        _wait_healthy([mixed, pd])
        yield {"a": a, "b": b, "c": c, "router": mixed, "pd": pd}
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(30)


def _chat(system: str | None, user: str, max_tokens: int = 6, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _metric(url: str, prefix: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))


def _stream_text(events: list[str]) -> str:
    out = []
    for event in events:
        if event.startswith("data: {"):
            for choice in json.loads(event[6:]).get("choices", []):
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


def test_load_spreads_over_both_replicas(cluster):
    router = cluster["router"].url

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{router}/v1/chat/completions",
                                                      json=_chat(None, f"Count to {i}.", max_tokens=8))
                                          for i in range(6)))

    answers = asyncio.run(burst())
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    served = [r.headers["x-dsinfer-replica"] for r in answers]
    counts = sorted(served.count(cluster[k].url) for k in "ab")
    assert counts[0] >= 2 and counts[1] <= 4, served  # no replica idle while the other queues
    assert all(r.headers["x-request-id"] for r in answers)


def test_repeated_long_prefix_goes_to_the_replica_holding_it(cluster):
    router = cluster["router"].url
    first = _post(router, _chat(SYSTEM, "What is two plus two?"))
    assert first.status_code == 200, first.text
    holder = first.headers["x-dsinfer-replica"]
    other = next(cluster[k] for k in "ab" if cluster[k].url != holder)
    holder_proc = next(cluster[k] for k in "ab" if cluster[k].url == holder)
    hits, other_hits = holder_proc.load()["prefix_cache_hits"], other.load()["prefix_cache_hits"]
    for question in ("What is three plus three?", "Name a colour.", "Say hello."):
        r = _post(router, _chat(SYSTEM, question))
        assert r.status_code == 200 and r.headers["x-dsinfer-replica"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert holder_proc.load()["prefix_cache_hits"] >= hits + 3 * 160  # the system prompt's blocks, each time
    assert other.load()["prefix_cache_hits"] == other_hits
    assert _metric(router, 'dsinfer_router_routing_decisions_total{reason="prefix_hit"}') >= 3


def test_prefill_decode_gives_one_replicas_greedy_output(cluster):
    pd, a, b = cluster["pd"].url, cluster["a"].url, cluster["b"].url
    # A prompt no earlier test sent: B may hold SYSTEM's first grain already (it can be the prefix holder above),
    # and then there would be nothing for it to load.
    body = _chat("Be brief. " + SYSTEM, "Name three fruits.", max_tokens=10)
    single = _post(a, body).json()
    reference = single["choices"][0]["message"]["content"]
    loaded = _metric(b, 'dsinfer_kv_store_hit_tokens_total{tier="dir"}')
    r = _post(pd, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-dsinfer-replica"] == b
    assert r.json()["choices"][0]["message"]["content"] == reference
    usage = r.json()["usage"]  # the prefill's first token counted once, as generated; C's grain as cached
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (single["usage"]["prompt_tokens"],
                                                                    single["usage"]["completion_tokens"])
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 128
    assert _metric(b, 'dsinfer_kv_store_hit_tokens_total{tier="dir"}') >= loaded + 128  # C's grain, loaded by B
    assert _metric(pd, "dsinfer_router_pd_first_tokens_total") == 1  # B started from C's first token

    body = _chat(SYSTEM + " Be kind.", "Name three animals.", max_tokens=10)
    single = _post(a, body).json()
    reference = single["choices"][0]["message"]["content"]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{pd}/v1/chat/completions", json=streamed, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [e for e in s.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert _stream_text(events) == reference
    usage = json.loads(events[-2][6:])["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (single["usage"]["prompt_tokens"],
                                                                    single["usage"]["completion_tokens"])
    assert _metric(pd, "dsinfer_router_pd_first_tokens_total") == 2

    # logprobs: B samples the first token itself (it has none for C's), the same text
    body = {"prompt": SYSTEM + " Fruits:", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    reference = httpx.post(f"{a}/v1/completions", json=body, timeout=120).json()["choices"][0]
    r = httpx.post(f"{pd}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference["text"]
    assert r.json()["choices"][0]["logprobs"]["tokens"] == reference["logprobs"]["tokens"]
    assert _metric(pd, "dsinfer_router_pd_first_tokens_total") == 2
    assert _metric(pd, 'dsinfer_router_routing_decisions_total{reason="prefill_bucket_0"}') == 3


def test_killed_replica_fails_no_unstarted_request_and_breaks_started_streams_cleanly(cluster):
    router, a = cluster["router"].url, cluster["a"]
    long = {"max_tokens": 64, "ignore_eos": True}
    retried = _metric(router, "dsinfer_router_retries_total")

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            streams, opened = [], []
            for i in range(2):  # one stream per replica (the second sees the first in flight)
                req = client.build_request("POST", f"{router}/v1/chat/completions",
                                           json={**_chat(None, f"Tell a story {i}."), **long, "stream": True})
                s = await client.send(req, stream=True)
                it = s.aiter_text()
                opened.append((s, it, await anext(it)))
                streams.append(s.headers["x-dsinfer-replica"])
            assert sorted(streams) == sorted([cluster["a"].url, cluster["b"].url])
            plain = [asyncio.ensure_future(client.post(f"{router}/v1/chat/completions",
                                                       json={**_chat(None, f"Write a poem {i}."), **long}))
                     for i in range(2)]
            deadline = time.monotonic() + 30
            while a.load()["num_running"] < 2:  # A holds its stream and one plain request
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            a.proc.send_signal(signal.SIGKILL)
            ends = []
            for s, it, first in opened:
                text = first + "".join([chunk async for chunk in it])
                ends.append((s.headers["x-dsinfer-replica"], [e for e in text.split("\n\n") if e][-1]))
            return ends, await asyncio.gather(*plain)

    ends, plain = asyncio.run(scenario())
    for replica, last in ends:
        if replica == a.url:
            assert last.startswith('data: {"error": ') and "failed mid-way" in last
        else:
            assert last == "data: [DONE]"
    assert all(r.status_code == 200 for r in plain), [r.text for r in plain]
    assert {r.headers["x-dsinfer-replica"] for r in plain} == {cluster["b"].url}
    assert _metric(router, "dsinfer_router_retries_total") >= retried + 1
    after = _post(router, _chat(None, "Still there?"))
    assert after.status_code == 200 and after.headers["x-dsinfer-replica"] == cluster["b"].url
    replicas = httpx.get(f"{router}/admin/replicas", timeout=10).json()["replicas"]
    assert {r["url"]: r["state"] for r in replicas}[a.url] == "ejected"


def test_sigterm_on_the_router_drains_in_flight_requests(cluster):
    pd = cluster["pd"]
    with httpx.stream("POST", f"{pd.url}/v1/chat/completions", timeout=120,
                      json={**_chat(None, "Count slowly."), "max_tokens": 24, "ignore_eos": True,
                            "stream": True}) as s:
        chunks = s.iter_text()
        first = next(chunks)
        pd.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{pd.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = _post(pd.url, _chat(None, "Hello?"))
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        text = first + "".join(chunks)
    assert [e for e in text.split("\n\n") if e][-1] == "data: [DONE]"
    assert pd.proc.wait(20) == 0
