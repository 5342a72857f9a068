"""The store's plan entries and outputs cross to a worker process as plain msgpack data."""

from __future__ import annotations

from dsinfer import LLM
from dsinfer.core import wire
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import KVLoad, KVSave, StepPlan
from tests.kvstore.conftest import GRAIN, make_prompts, run, token_ids


def test_store_entries_round_trip_through_the_wire():
    plan = StepPlan(kv_loads=[KVLoad("r1", [b"k" * 16, b"l" * 16], [-1, 5, 6, 7])],
                    kv_saves=[KVSave([b"s" * 16], [3, 4], 86400.0)], kv_poll_s=0.005)
    assert wire.decode(wire.encode(plan)) == plan
    windowed = StepPlan(kv_loads=[KVLoad("r2", [], [], b"w" * 16, [-1, 9, 10, -1], 64)],
                        kv_saves=[KVSave([], [], 60.0, [b"v" * 16], [[11, 12]])])
    assert wire.decode(wire.encode(windowed)) == windowed
    out = RunnerOutput(kv_loads_done={"r1": 64}, kv_host_events=[[b"k" * 16, True], [b"l" * 16, False]],
                       kv_store_counters={"loads": 1.0})
    assert wire.decode(wire.encode(out)) == out


def test_a_worker_process_loads_what_another_engine_saved(tiny_llama_dir, cold, tmp_path):
    prompts = make_prompts(50, n=2)
    writer = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN})
    run(writer, prompts)
    writer.engine.flush_kv_store()
    reader = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN},
                 distributed_executor_backend="mp")
    try:
        out = run(reader, prompts)
        assert token_ids(out) == cold("llama", prompts)
        assert [o.num_cached_tokens for o in out] == [96, 96]
        assert reader.engine.kv_store_stats()["hit_tokens_dir"] >= 96
    finally:
        reader.engine.shutdown()


def test_a_worker_process_loads_a_sliding_window_state(tiny_llama_dir, tmp_path):
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 24}
    prompts = make_prompts(51, n=2)
    cold = token_ids(run(LLM(str(tiny_llama_dir), hf_overrides=mistral, enable_prefix_caching=False), prompts))
    writer = LLM(str(tiny_llama_dir), hf_overrides=mistral, kv_store={"dir": str(tmp_path), "grain": GRAIN})
    run(writer, prompts)
    writer.engine.flush_kv_store()
    reader = LLM(str(tiny_llama_dir), hf_overrides=mistral, kv_store={"dir": str(tmp_path), "grain": GRAIN},
                 distributed_executor_backend="mp")
    try:
        out = run(reader, prompts)
        assert token_ids(out) == cold
        assert [o.num_cached_tokens for o in out] == [96, 96]
    finally:
        reader.engine.shutdown()
