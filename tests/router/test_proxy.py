"""The pool's health checks and the proxy's retries and stream relay, against replicas faked with
httpx.MockTransport (no process, no socket)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from dsinfer.router.policy import LoadAware, RequestInfo
from dsinfer.router.pool import ReplicaPool
from dsinfer.router.proxy import Forward, Proxy
from dsinfer.router.settings import RouterSettings

LOAD = {"status": "ok", "num_running": 0, "num_waiting": 0, "num_kv_tokens": 0, "max_num_seqs": 8,
        "kv_capacity_tokens": 4096, "block_size": 16, "kv_store_dir": None}


class _Broken(httpx.AsyncByteStream):
    """A stream whose replica dies after one whole event and half of the next."""

    async def __aiter__(self):
        yield b'data: {"n": 1}\n\n'
        yield b'data: {"n": 2, "half'
        raise httpx.ReadError("connection reset by peer")


def _pool(handler, settings: RouterSettings | None = None) -> tuple[ReplicaPool, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return ReplicaPool(settings or RouterSettings(retry_backoff_s=0.0, readmit_after=2), client), client


def _chooser(pool: ReplicaPool):
    policy = LoadAware()

    def choose(tried):
        replicas = pool.available(("mixed",))
        left = [r for r in replicas if r.url not in tried] or replicas
        return policy.choose(left, RequestInfo(10)) if left else None

    return choose


def _forward(path: str = "/v1/chat/completions", stream: bool = False) -> Forward:
    return Forward("POST", path, b"{}", [("content-type", "application/json")], stream, RequestInfo(10))


async def _body(response) -> bytes:
    if hasattr(response, "body_iterator"):
        return b"".join([chunk async for chunk in response.body_iterator])
    return response.body


def test_health_checks_eject_at_once_on_refused_connection_and_readmit_after_two_good_ones():
    down = {"b": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b" and down["b"]:
            raise httpx.ConnectError("connection refused")
        if request.url.host == "c":
            return httpx.Response(200, json={**LOAD, "status": "draining"})
        return httpx.Response(200, json=LOAD)

    async def run():
        pool, client = _pool(handler)
        a, b, c = pool.add("http://a"), pool.add("http://b"), pool.add("http://c/")
        await pool.check_all()
        assert (a.state, b.state, c.state) == ("healthy", "healthy", "ejected")  # a draining replica stays out
        b.num_routed = 1
        down["b"] = True
        await pool.check_all()
        assert b.state == "ejected"
        down["b"] = False
        await pool.check_all()
        assert b.state == "ejected"  # one good answer is not enough
        await pool.check_all()
        assert b.state == "healthy" and b.load["kv_capacity_tokens"] == 4096
        text = pool.metrics.render().decode()
        assert 'dsinfer_router_ejections_total{cause="connect",replica="http://b"} 1.0' in text
        await client.aclose()

    asyncio.run(run())


def test_a_503_and_a_refused_connection_are_retried_on_another_replica():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":  # c looks busier: a and b are tried first
            return httpx.Response(200, json={**LOAD, "num_running": 3 if request.url.host == "c" else 0})
        seen.append(request.url.host)
        if request.url.host == "a":
            return httpx.Response(503, json={"error": {"message": "draining"}})
        if request.url.host == "b":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"ok": True}, headers={"x-request-id": request.headers["x-request-id"]})

    async def run():
        pool, client = _pool(handler)
        for host in "abc":
            pool.add(f"http://{host}")
        await pool.check_all()
        proxy = Proxy(pool, client, random.Random(0))
        fwd = _forward()
        fwd.headers.append(("x-request-id", "rid-1"))
        response = await proxy.send(fwd, _chooser(pool))
        assert response.status_code == 200 and json.loads(await _body(response)) == {"ok": True}
        assert response.headers["x-dsinfer-replica"] == "http://c" and response.headers["x-request-id"] == "rid-1"
        assert sorted(seen[:2]) == ["a", "b"] and seen[2:] == ["c"]
        assert pool.replicas["http://a"].state == pool.replicas["http://b"].state == "ejected"
        text = pool.metrics.render().decode()
        assert 'dsinfer_router_retries_total{cause="status_503"} 1.0' in text
        assert 'dsinfer_router_retries_total{cause="connect"} 1.0' in text
        await client.aclose()

    asyncio.run(run())


def test_without_replicas_left_the_last_503_is_the_answer():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            return httpx.Response(200, json=LOAD)
        return httpx.Response(503, json={"error": {"message": "the server is shutting down"}})

    async def run():
        pool, client = _pool(handler, RouterSettings(retry_backoff_s=0.0, max_retries=2))
        pool.add("http://a")
        await pool.check_all()
        response = await Proxy(pool, client).send(_forward(), _chooser(pool))
        assert response.status_code == 503
        assert b"the server is shutting down" in await _body(response)  # the replica's own reason
        assert pool.replicas["http://a"].state == "ejected" and pool.available(("mixed",)) == []
        await client.aclose()

    asyncio.run(run())


def test_a_stream_broken_mid_way_ends_after_its_last_whole_event_with_an_error_event():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            return httpx.Response(200, json=LOAD)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Broken())

    async def run():
        pool, client = _pool(handler)
        pool.add("http://a")
        await pool.check_all()
        proxy = Proxy(pool, client)
        for path, last in (("/v1/chat/completions", b"data: {\"error\": "), ("/v1/messages", b"event: error\n")):
            response = await proxy.send(_forward(path, stream=True), _chooser(pool))
            assert response.status_code == 200
            events = (await _body(response)).split(b"\n\n")
            assert events[0] == b'data: {"n": 1}' and events[1].startswith(last) and events[2:] == [b""]
            assert b"failed mid-way" in events[1] and b"half" not in events[1]
        assert pool.replicas["http://a"].in_flight == 0
        assert "dsinfer_router_stream_errors_total 2.0" in pool.metrics.render().decode()
        await client.aclose()

    asyncio.run(run())
