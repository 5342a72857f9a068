"""Prometheus metrics of one server (its own CollectorRegistry), and the ASGI hook counting responses."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
KNOWN_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    }
)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dsinfer_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "dsinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("dsinfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "dsinfer_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "dsinfer_time_per_output_token_seconds",
            "Mean time per output token after the first",
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.e2e = Histogram(
            "dsinfer_e2e_request_latency_seconds",
            "End-to-end request latency",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.running = Gauge("dsinfer_num_requests_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("dsinfer_num_requests_waiting", "Requests waiting in the engine", registry=r)
        self.kv_usage = Gauge(
            "dsinfer_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "dsinfer_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens)", registry=r
        )

    def record_request(self, num_prompt: int, num_generated: int, num_steps: int, ttft: float | None,
                       e2e: float) -> None:
        """``num_generated``: every choice's tokens; ``num_steps``: the longest choice's (the decode steps), over
        which the time per output token is taken."""
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_steps > 1:
                self.tpot.observe((e2e - ttft) / (num_steps - 1))

    def render(self, stats: dict[str, Any]) -> bytes:
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_hit_rate.set(stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI wrapper counting every response by path (unknown paths as "other") and status."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
