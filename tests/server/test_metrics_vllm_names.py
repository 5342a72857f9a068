"""/metrics speaks vLLM's names too: every dsinfer figure again as ``vllm:*`` with the ``model_name`` label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from dsinfer.server.metrics import VLLM_NAMES, ServerMetrics

STATS = {"num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.25, "num_preemptions": 4,
         "prefix_cache_queries": 100, "prefix_cache_hits": 40,
         "spec_decode": {"num_drafts": 5, "num_proposals": 6, "num_proposed_tokens": 16, "num_draft_tokens": 15,
                         "num_verified_tokens": 15, "num_accepted_tokens": 9, "accepted_per_position": [5, 3, 1],
                         "acceptance_rate": 0.6, "mean_acceptance_length": 2.8}}


def _samples(metrics: ServerMetrics, stats: dict) -> dict[tuple[str, tuple], float]:
    text = metrics.render(stats).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dsinfer_metric_has_its_vllm_twin_with_the_same_values():
    metrics = ServerMetrics("my-model")
    metrics.record_request(7, 10, 5, ttft=0.02, e2e=0.5, finish_reasons=("stop", "length"))
    metrics.record_request(3, 4, 4, ttft=0.01, e2e=0.2, finish_reasons=("stop",))
    samples = _samples(metrics, STATS)
    model = (("model_name", "my-model"),)
    twins = 0
    for (name, labels), value in samples.items():
        for ours, vllm in VLLM_NAMES.items():
            if name.startswith(ours) and name[len(ours):] in ("", "_total", "_count", "_sum", "_bucket"):
                twin = (vllm + name[len(ours):], tuple(sorted(labels + model)))
                assert samples[twin] == value, (name, labels)
                twins += 1
    assert twins > len(VLLM_NAMES)  # every mapping is alive (histograms add buckets)
    for ours in VLLM_NAMES:
        assert any(name.startswith(ours) for name, _ in samples), f"{ours} is mapped but never exported"

    assert samples[("vllm:num_requests_running", model)] == 3
    assert samples[("vllm:num_requests_waiting", model)] == 2
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:num_preemptions_total", model)] == 4
    assert samples[("vllm:prefix_cache_queries_total", model)] == 100
    assert samples[("vllm:prefix_cache_hits_total", model)] == 40
    assert samples[("vllm:prompt_tokens_total", model)] == 10
    assert samples[("vllm:generation_tokens_total", model)] == 14
    success = {dict(labels)["finished_reason"]: value for (name, labels), value in samples.items()
               if name == "vllm:request_success_total"}
    assert success == {"stop": 2, "length": 1}
    assert samples[("vllm:request_prompt_tokens_count", model)] == 2
    assert samples[("vllm:request_prompt_tokens_sum", model)] == 10
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 2
    assert samples[("vllm:time_to_first_token_seconds_sum", model)] == 0.03
    assert samples[("vllm:request_time_per_output_token_seconds_count", model)] == 2
    assert samples[("vllm:spec_decode_num_drafts_total", model)] == 5
    assert samples[("vllm:spec_decode_num_draft_tokens_total", model)] == 15
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", model)] == 9
    per_pos = {dict(labels)["position"]: value for (name, labels), value in samples.items()
               if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 5, "1": 3, "2": 1}
    assert samples[("dsinfer_spec_decode_num_proposed_tokens_total", ())] == 16
    assert samples[("dsinfer_spec_decode_num_verified_tokens_total", ())] == 15
    assert samples[("dsinfer_spec_decode_num_proposals_total", ())] == 6
    assert samples[("dsinfer_spec_decode_mean_acceptance_length", ())] == 2.8


def test_spec_decode_metrics_are_absent_without_speculation():
    samples = _samples(ServerMetrics(), {k: v for k, v in STATS.items() if k != "spec_decode"})
    assert not any("spec_decode" in name for name, _ in samples)


def test_the_engine_counters_follow_the_latest_stats():
    metrics = ServerMetrics()
    first = _samples(metrics, {})  # before the engine has reported
    assert first[("vllm:num_preemptions_total", (("model_name", "default"),))] == 0
    assert first[("dsinfer_num_preemptions_total", ())] == 0
    later = _samples(metrics, {**STATS, "num_preemptions": 9})
    assert later[("vllm:num_preemptions_total", (("model_name", "default"),))] == 9
    assert later[("dsinfer_num_preemptions_total", ())] == 9
