"""Prometheus metrics of one server (its own CollectorRegistry), and the ASGI hook counting responses.

Every metric is exposed twice: under dsinfer's names (``dsinfer_*``) and under vLLM's (``vllm:*``, with the
``model_name`` label), so dashboards, alerts and autoscalers written for vLLM read a dsinfer server unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# tokens a request: 1-2-5 steps up to a million (vLLM's buckets follow the same series up to max_model_len)
_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
# dsinfer's metric -> vLLM's name for the same figure
VLLM_NAMES = {
    "dsinfer_num_requests_running": "vllm:num_requests_running",
    "dsinfer_num_requests_waiting": "vllm:num_requests_waiting",
    "dsinfer_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # vLLM's too is a fraction (1 = full)
    "dsinfer_prompt_tokens": "vllm:prompt_tokens",
    "dsinfer_generation_tokens": "vllm:generation_tokens",
    "dsinfer_request_success": "vllm:request_success",
    "dsinfer_request_prompt_tokens": "vllm:request_prompt_tokens",
    "dsinfer_request_generation_tokens": "vllm:request_generation_tokens",
    "dsinfer_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    # a request's mean time per output token: vLLM's request_time_per_output_token_seconds
    "dsinfer_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "dsinfer_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "dsinfer_num_preemptions": "vllm:num_preemptions",
    "dsinfer_prefix_cache_queries": "vllm:prefix_cache_queries",
    "dsinfer_prefix_cache_hits": "vllm:prefix_cache_hits",
    "dsinfer_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "dsinfer_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "dsinfer_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "dsinfer_spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
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
    def __init__(self, model_name: str = "default") -> None:
        self.registry = CollectorRegistry()
        self.engine_stats: dict[str, Any] = {}  # as of the last render
        r = self.registry
        self.requests = Counter(
            "dsinfer_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "dsinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("dsinfer_generation_tokens", "Generated tokens", registry=r)
        self.request_success = Counter(
            "dsinfer_request_success", "Finished choices by finish reason", ["finished_reason"], registry=r
        )
        self.request_prompt_tokens = Histogram(
            "dsinfer_request_prompt_tokens", "Prompt tokens of a finished request", registry=r,
            buckets=_COUNT_BUCKETS,
        )
        self.request_generation_tokens = Histogram(
            "dsinfer_request_generation_tokens", "Generated tokens of a finished request (all its choices)",
            registry=r, buckets=_COUNT_BUCKETS,
        )
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
        r.register(_EngineCounters(self))
        self.vllm_registry = CollectorRegistry()  # the same figures under vLLM's names, read from the one above
        self.vllm_registry.register(_VllmNames(self.registry, model_name))

    def record_request(self, num_prompt: int, num_generated: int, num_steps: int, ttft: float | None,
                       e2e: float, finish_reasons: tuple[str | None, ...] = ()) -> None:
        """``num_generated``: every choice's tokens; ``num_steps``: the longest choice's (the decode steps), over
        which the time per output token is taken; ``finish_reasons``: each choice's."""
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_generated)
        for reason in finish_reasons:
            self.request_success.labels(reason or "abort").inc()
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_steps > 1:
                self.tpot.observe((e2e - ttft) / (num_steps - 1))

    def render(self, stats: dict[str, Any]) -> bytes:
        self.engine_stats = stats
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_hit_rate.set(stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)


class _EngineCounters:
    """The engine's own running totals (preemptions, prefix-cache token queries and hits) as counters."""

    _FIELDS = (
        ("dsinfer_num_preemptions", "num_preemptions", "Requests preempted (KV blocks freed for recompute)"),
        ("dsinfer_prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
        ("dsinfer_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    )

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    # speculative decoding (engine stats["spec_decode"], present when speculation is on); vLLM's names for the
    # first three and the per-position counts; "proposed" counts drafts before the budget / confidence cut them
    _SPEC_FIELDS = (
        ("dsinfer_spec_decode_num_drafts", "num_drafts", "Request-steps that verified draft tokens"),
        ("dsinfer_spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens verified"),
        ("dsinfer_spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted"),
        ("dsinfer_spec_decode_num_proposed_tokens", "num_proposed_tokens", "Draft tokens the drafter proposed"),
        ("dsinfer_spec_decode_num_verified_tokens", "num_verified_tokens",
         "Draft tokens verified (as num_draft_tokens; fewer than proposed under confidence scheduling)"),
        ("dsinfer_spec_decode_num_proposals", "num_proposals", "Request-steps the drafter proposed drafts for"),
    )

    # the KV store (engine stats["kv_store"], present when --kv-store is set): kvstore.counters' names
    _STORE_FIELDS = (
        ("lookups", "Grains looked up in the KV store at admission"),
        ("bytes_loaded", "Bytes of KV loaded from the KV store"),
        ("bytes_saved", "Bytes of KV saved to the KV store"),
        ("queue_drops", "Grain saves dropped by a full write-behind queue"),
        ("save_errors", "Grain saves that failed (the directory full, over its budget or quota, or an error)"),
        ("load_errors", "KV store loads cut short by an unexpected error (the rest of the prompt recomputed)"),
        ("expiries", "KV store entries past their traffic class's TTL"),
        ("corrupt_files", "KV store files removed as foreign, truncated or corrupt"),
    )

    def collect(self) -> Iterator[Metric]:
        for name, key, doc in self._FIELDS:
            yield CounterMetricFamily(name, doc, value=self.metrics.engine_stats.get(key, 0))
        yield from self._store()
        yield from self._eplb()
        spec = self.metrics.engine_stats.get("spec_decode")
        if not spec:
            return
        for name, key, doc in self._SPEC_FIELDS:
            yield CounterMetricFamily(name, doc, value=spec[key])
        per_pos = CounterMetricFamily("dsinfer_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position (0: the first draft)",
                                      labels=["position"])
        for position, count in enumerate(spec["accepted_per_position"]):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        yield GaugeMetricFamily("dsinfer_spec_decode_mean_acceptance_length",
                                "Tokens a verifying step gives a request: 1 + accepted / drafts",
                                value=spec["mean_acceptance_length"])


    def _eplb(self) -> Iterator[Metric]:
        """EPLB's balancedness over the load window (engine stats["eplb"], present once a window came back)."""
        eplb = self.metrics.engine_stats.get("eplb")
        if not eplb:
            return
        family = GaugeMetricFamily("dsinfer_moe_lb", "MoE balancedness over the EPLB window: slowest EP rank's "
                                   "tokens / mean rank's, by MoE layer (0: the first MoE layer)", labels=["layer"])
        for layer, value in enumerate(eplb["moe_lb"]):
            family.add_metric([str(layer)], value)
        yield family
        yield GaugeMetricFamily("dsinfer_moe_lb_overall", "MoE balancedness over all MoE layers: their slowest "
                                "ranks' tokens summed / their mean ranks' summed", value=eplb["moe_lb_overall"])
        yield CounterMetricFamily("dsinfer_eplb_rebalances", "EPLB rebalances completed",
                                  value=eplb.get("num_rebalances", 0))
        yield CounterMetricFamily("dsinfer_eplb_received_bytes", "Expert weights rank 0 received from other "
                                  "expert-parallel ranks in rebalances", value=eplb.get("received_bytes", 0))

    def _store(self) -> Iterator[Metric]:
        store = self.metrics.engine_stats.get("kv_store")
        if not store:
            return
        for key, doc in self._STORE_FIELDS:
            yield CounterMetricFamily(f"dsinfer_kv_store_{key}", doc, value=store.get(key, 0))
        for key, doc in (("hit_tokens", "Prompt tokens loaded from the KV store, by tier"),
                         ("evictions", "KV store entries evicted (LRU under the high watermark), by tier")):
            family = CounterMetricFamily(f"dsinfer_kv_store_{key}", doc, labels=["tier"])
            for tier in ("host", "dir"):
                family.add_metric([tier], store.get(f"{key}_{tier}", 0))
            yield family
        yield SummaryMetricFamily("dsinfer_kv_store_load_seconds", "KV store loads: from admission to read",
                                  count_value=store.get("loads", 0), sum_value=store.get("load_seconds", 0.0))


class _VllmNames:
    """The metrics of ``source`` that vLLM has too, under vLLM's names and with its ``model_name`` label."""

    def __init__(self, source: CollectorRegistry, model_name: str):
        self.source = source
        self.label = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            name = VLLM_NAMES.get(family.name)
            if name is None:
                continue
            renamed = Metric(name, family.documentation, family.type)
            for sample in family.samples:
                renamed.add_sample(name + sample.name[len(family.name):], {**sample.labels, **self.label},
                                   sample.value, sample.timestamp, sample.exemplar)
            yield renamed


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
