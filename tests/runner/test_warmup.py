"""The prefill warm-up: which step sizes it runs, its dummy batches, and that it stores nothing and never raises."""

from __future__ import annotations

import logging

import pytest
import torch

from dsinfer.runner.warmup import dummy_prefill_batch, prefill_token_counts, warm_up_prefill


def test_token_counts_span_one_token_to_the_budget():
    assert prefill_token_counts(1) == [1]
    assert prefill_token_counts(20) == [1, 15, 16, 19, 20]
    counts = prefill_token_counts(8192)
    assert counts[0] == 1 and counts[-2:] == [8191, 8192]
    assert {2**k for k in range(4, 14)} <= set(counts) and {2**k - 1 for k in range(4, 14)} <= set(counts)


def test_dummy_batch_cuts_prompts_and_stores_nothing():
    batch = dummy_prefill_batch(2500, 1024, 16, torch.device("cpu"))
    assert batch.seq_lens.tolist() == [1024, 1024, 452]
    assert batch.query_start_loc.tolist() == [0, 1024, 2048, 2500]
    assert batch.positions[1024:1027].tolist() == [0, 1, 2] and int(batch.positions[-1]) == 451
    assert bool((batch.slot_mapping == -1).all()) and batch.block_tables.shape == (3, 64)
    assert batch.logits_indices.tolist() == [1023, 2047, 2499]
    assert batch.max_query_len == batch.max_seq_len == 1024 and not batch.is_decode_only
    mixed = dummy_prefill_batch(100, 64, 16, torch.device("cpu"), decode_rows=6, decode_context=40)
    assert mixed.seq_lens.tolist() == [40] * 6 + [64, 30] and mixed.query_start_loc.tolist()[-3:] == [6, 70, 100]
    assert mixed.positions[:6].tolist() == [39] * 6 and mixed.block_tables.shape == (8, 4)
    assert mixed.max_query_len == 64 and mixed.max_seq_len == 64


class _Recorder(torch.nn.Module):
    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.sizes, self.fail_at = [], fail_at

    def forward(self, input_ids, positions, batch):
        if batch.num_tokens == self.fail_at:
            raise RuntimeError("boom")
        self.sizes.append(batch.num_tokens)
        return torch.zeros(batch.num_tokens, 4)

    def compute_logits(self, hidden):
        return hidden


def test_warm_up_runs_every_size_and_logs_a_failure(caplog):
    model = _Recorder()
    warm_up_prefill(model, 100, 64, 16, torch.device("cpu"))
    counts = prefill_token_counts(100)
    assert model.sizes == [n for n in counts for _ in range(2 if n >= 32 else 1)]  # prompt-only and mixed
    failing = _Recorder(fail_at=31)
    with caplog.at_level(logging.WARNING, logger="dsinfer"):
        warm_up_prefill(failing, 100, 64, 16, torch.device("cpu"))  # logged, not raised
    assert failing.sizes == [1, 15, 16] and "prefill warm-up failed (RuntimeError: boom)" in caplog.text


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_warm_up_on_a_real_model_leaves_the_kv_cache_alone(arch, tmp_path):
    import transformers

    from dsinfer import LLM

    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        hf = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV2Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
        hf = transformers.DeepseekV2ForCausalLM(cfg)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=200, max_num_batched_tokens=300)
    runner = llm.engine.runner
    caches = [layer.kv_cache.clone() for layer in runner.model.attention_layers()]
    warm_up_prefill(runner.model, 300, 200, runner.block_size, torch.device("cpu"))
    for layer, before in zip(runner.model.attention_layers(), caches):
        assert torch.equal(layer.kv_cache.nan_to_num(), before.nan_to_num())
