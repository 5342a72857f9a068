"""The router's HTTP front: the OpenAI and Anthropic routes of ``dsinfer serve`` forwarded to its replicas,
``/v1/models`` from one of them, and its own ``/health``, ``/metrics`` and ``/admin/replicas``.

Generation routes (chat, completions, responses, messages) are routed by the policy over the mixed and decode
replicas, through prefill/decode disaggregation when the pool has prefill replicas; the other routes
(count_tokens, tokenize, models) go to any available replica. ``/admin/replicas``: GET lists the replicas, POST
``{"url": ..., "role": "mixed" | "prefill" | "decode"}`` adds one, DELETE ``{"url": ...}`` removes one (its
requests in flight finish); it takes ``Authorization: Bearer <--admin-key>``, or without an admin key answers
loopback clients only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from dsinfer.router.disagg import Disaggregation
from dsinfer.router.policy import PrefillBuckets, RequestInfo, make_policy
from dsinfer.router.pool import ReplicaPool
from dsinfer.router.prompt import PromptReader, request_info
from dsinfer.router.proxy import Chooser, Forward, Proxy, error_response, forward_headers
from dsinfer.router.settings import RouterSettings

logger = logging.getLogger("dsinfer.router")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
OTHER_POST_ROUTES = ("/v1/messages/count_tokens", "/tokenize", "/detokenize")
SERVING_ROLES = ("mixed", "decode")
ANY_ROLE = ("mixed", "decode", "prefill")


class Router:
    """The pool, the policy and the forwarding of one router process."""

    def __init__(self, settings: RouterSettings, replicas: list[tuple[str, str]], reader: PromptReader | None):
        self.settings = settings
        self.reader = reader
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.pool = ReplicaPool(settings, self.client)
        for url, role in replicas:
            self.pool.add(url, role)
        self.policy = make_policy(settings)
        self.proxy = Proxy(self.pool, self.client)
        self.disagg = Disaggregation(self.proxy, PrefillBuckets(rebalance_s=settings.bucket_rebalance_s))
        self.draining = False
        self.in_flight = 0  # client requests being answered (the drain waits for 0)

    def chooser(self, info: RequestInfo, roles: tuple[str, ...]) -> Chooser:
        """The policy over the available replicas of ``roles``, those not yet tried first."""
        def choose(tried: set[str]):
            replicas = self.pool.available(roles)
            left = [r for r in replicas if r.url not in tried] or replicas
            return self.policy.choose(left, info) if left else None

        return choose

    async def handle(self, request: Request, path: str) -> Response:
        content = await request.body()
        body = _json_object(content)
        info = (await asyncio.to_thread(request_info, self.reader, path, body, len(content), self.pool.block_sizes())
                if path in GENERATION_ROUTES else RequestInfo(max(len(content) // 4, 1)))
        stream = body is not None and body.get("stream") is True
        fwd = Forward(request.method, path, content, forward_headers(list(request.headers.items())), stream, info,
                      remember_prefix=path in GENERATION_ROUTES)
        if path not in GENERATION_ROUTES:
            return await self.proxy.send(fwd, self.chooser(info, ANY_ROLE))
        decode = self.chooser(info, SERVING_ROLES)
        if any(r.role == "prefill" for r in self.pool.replicas.values()):
            return await self.disagg.serve(fwd, body, decode)
        return await self.proxy.send(fwd, decode)


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(content)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.pool.check_all()  # the replicas already up are admitted before the first request
        router.pool.start()
        yield
        await router.pool.stop()
        await router.client.aclose()

    app = FastAPI(title="dsinfer router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    async def forward(request: Request) -> Response:
        if router.draining:
            return error_response(request.url.path, 503, "the router is shutting down and accepts no new requests")
        response = await router.handle(request, request.url.path)
        _count(router, request.url.path, response)
        return response

    for path in (*GENERATION_ROUTES, *OTHER_POST_ROUTES):
        app.add_api_route(path, forward, methods=["POST"])
    for path in ("/v1/models", "/v1/models/{name:path}", "/version"):
        app.add_api_route(path, forward, methods=["GET"])

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if router.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        serving = router.pool.available(SERVING_ROLES)
        if not serving:
            return JSONResponse({"status": "no replica available"}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": len(serving)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.pool.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    _add_admin_routes(app, router)
    app.add_middleware(InFlight, router=router)
    return app


def _count(router: Router, path: str, response: Response) -> None:
    route = "/v1/models" if path.startswith("/v1/models/") else path
    router.pool.metrics.requests.labels(route, str(response.status_code)).inc()


class InFlight:
    """ASGI: counts the client requests being answered, until their last byte is sent (the drain waits for 0)."""

    def __init__(self, app: Any, router: Router):
        self.app = app
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in ("/health", "/metrics") or path.startswith("/admin"):
            return await self.app(scope, receive, send)
        self.router.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.router.in_flight -= 1


def _add_admin_routes(app: FastAPI, router: Router) -> None:
    def refused(request: Request) -> Response | None:
        key = router.settings.admin_key
        if key is not None:
            offered = request.headers.get("authorization", "")
            if hmac.compare_digest(offered.encode(), f"Bearer {key}".encode()):
                return None
            return JSONResponse({"error": "the admin routes need Authorization: Bearer <--admin-key>"}, 401)
        host = request.client.host if request.client else ""
        try:
            if ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            pass
        return JSONResponse({"error": "without --admin-key the admin routes answer loopback clients only"}, 403)

    def describe(r) -> dict[str, Any]:
        return {"url": r.url, "role": r.role, "state": r.state_label(), "in_flight": r.in_flight,
                "num_routed": r.num_routed, "num_requests": r.num_requests, "num_kv_tokens": r.num_kv_tokens,
                "load": r.load}

    @app.get("/admin/replicas")
    async def list_replicas(request: Request) -> Response:
        return refused(request) or JSONResponse({"replicas": [describe(r) for r in router.pool.replicas.values()]})

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        body = _json_object(await request.body()) or {}
        try:
            replica = router.pool.add(str(body.get("url", "")), str(body.get("role", "mixed")))
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, 409 if "already" in str(exc) else 400)
        await router.pool.check(replica)
        return JSONResponse(describe(replica), 201)

    @app.delete("/admin/replicas")
    async def remove_replica(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        body = _json_object(await request.body()) or {}
        url = str(body.get("url") or request.query_params.get("url", ""))
        try:
            replica = router.pool.remove(url)
        except (KeyError, ValueError):
            return JSONResponse({"error": f"no replica {url!r} in the pool"}, 404)
        return JSONResponse(describe(replica))
