"""The router's Prometheus metrics (its own CollectorRegistry), ``GET /metrics`` of ``dsinfer router``.

Per replica (label ``replica``: its URL): load as the router balances on it (``axis``: requests, kv_tokens,
in_flight) and its state (one series per state, 1 for the current one); routing decisions by reason; retries by
cause; ejections by cause; requests by route and status; time to first byte (streams) and end-to-end latency as
the client sees them at the router.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from dsinfer.router.replica import STATES, Replica

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _ReplicaCollector:
    """Reads the replicas at scrape time (no gauge to keep in step)."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]]):
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        load = GaugeMetricFamily("dsinfer_router_replica_load", "a replica's load as the router balances on it",
                                 labels=["replica", "role", "axis"])
        state = GaugeMetricFamily("dsinfer_router_replica_state", "1 for a replica's current state",
                                  labels=["replica", "role", "state"])
        routed = GaugeMetricFamily("dsinfer_router_replica_routed", "requests sent to a replica since it was added",
                                   labels=["replica", "role"])
        for r in self.replicas():
            for axis, value in (("requests", r.num_requests), ("kv_tokens", r.num_kv_tokens),
                                ("in_flight", r.in_flight)):
                load.add_metric([r.url, r.role, axis], value)
            current = r.state_label()
            for name in (*STATES, "open"):
                state.add_metric([r.url, r.role, name], 1.0 if name == current else 0.0)
            routed.add_metric([r.url, r.role], r.num_routed)
        yield from (load, state, routed)


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Iterable[Replica]]):
        self.registry = reg = CollectorRegistry()
        reg.register(_ReplicaCollector(replicas))
        self.decisions = Counter("dsinfer_router_routing_decisions", "replica choices by reason", ["reason"],
                                 registry=reg)
        self.retries = Counter("dsinfer_router_retries", "requests sent again before their first byte, by cause",
                               ["cause"], registry=reg)
        self.ejections = Counter("dsinfer_router_ejections", "replicas taken out of rotation, by cause",
                                 ["replica", "cause"], registry=reg)
        self.breaker_opens = Counter("dsinfer_router_breaker_opens", "circuit breakers opened", ["replica"],
                                     registry=reg)
        self.requests = Counter("dsinfer_router_requests", "requests answered, by route and status",
                                ["route", "status"], registry=reg)
        self.stream_errors = Counter("dsinfer_router_stream_errors",
                                     "streams that broke after their first byte (ended with an error event)",
                                     registry=reg)
        self.first_tokens = Counter("dsinfer_router_pd_first_tokens",
                                    "P/D: decode requests sent on with the prefill replica's first token", registry=reg)
        self.ttft = Histogram("dsinfer_router_time_to_first_byte_seconds",
                              "streams: request arrival to the first byte relayed (the first token's event)",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("dsinfer_router_e2e_request_latency_seconds",
                             "request arrival to the last byte relayed", buckets=_LATENCY_BUCKETS, registry=reg)

    def render(self) -> bytes:
        return generate_latest(self.registry)
