"""Roofline floors (``dsinfer/bench/roofline.py``) and the DeepSeek paths of ``dsinfer bench latency`` (the
runner's step tables) and ``throughput --compare-hf``, on CPU.

Floors are checked against hand counts on the real Llama-3.1-8B / V2-Lite / V3 shapes (built on the meta device: no
memory), and against the vLLM peer's figure for V2-Lite (1.17 ms at B=1). The commands run end to end on tiny
random DeepSeek configs; the HF comparison's weight copy is checked by logits at unit-scale weights, where a
misplaced tensor shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsinfer.bench import hf_compare, roofline
from dsinfer.entrypoints.cli import main
from dsinfer.models.loader.model_loader import _default_dtype_and_device
from dsinfer.models.registry import model_class

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
V3_5L = {"num_hidden_layers": 5, "first_k_dense_replace": 3, "num_nextn_predict_layers": 0}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
            bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, hidden_act="silu")
TINY_V2 = dict(TINY, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=3,
               q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
               topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
               n_group=1, topk_group=1)
TINY_V3 = dict(TINY, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=3,
               q_lora_rank=24, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
               topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
               n_group=4, topk_group=2, num_nextn_predict_layers=1)


def meta_model(name: str, overrides: dict | None = None):
    cfg = json.loads((CONFIGS / name / "config.json").read_text()) | (overrides or {})
    with _default_dtype_and_device(torch.bfloat16, torch.device("meta")):
        return model_class(cfg["architectures"][0])(cfg), cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_expected_distinct_experts():
    assert roofline.expected_distinct_experts(64, 6, 1) == pytest.approx(6)
    assert roofline.expected_distinct_experts(64, 6, 64) == pytest.approx(63.88, abs=0.01)
    assert roofline.expected_distinct_experts(256, 8, 64) == pytest.approx(222.4, abs=0.1)
    assert roofline.expected_distinct_experts(0, 0, 8) == 0


def test_v2_lite_decode_floor_matches_a_hand_count():
    model, c = meta_model("deepseek-v2-lite")
    shape = roofline.weight_shape(model)
    h, layers, heads, r, rope = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], 512, 64
    attn = (h * heads * 192 + h * (r + rope) + r * heads * 256 + heads * 128 * h  # q, kv_a, kv_b, o
            + 2 * h + r)  # input / post-attention / kv_a norms
    expert = 3 * h * c["moe_intermediate_size"]
    moe_layers = layers - 1
    always = 2 * (layers * attn + 3 * h * c["intermediate_size"] + moe_layers * 2 * expert  # dense + shared
                  + h + c["vocab_size"] * h) + 4 * moe_layers * 64 * h  # final norm, lm_head; fp32 routers
    assert shape.always_bytes == always
    assert shape.expert_bytes == [2 * expert] * moe_layers and (shape.num_experts, shape.top_k) == (64, 6)
    kv_token = layers * (r + rope) * 2
    bandwidth = 4.19e12  # the peer measured 4.08-4.19 TB/s and a 1.17 ms floor at B=1
    assert roofline.decode_floor_ms(shape, 1, 1032, kv_token, bandwidth) == pytest.approx(1.17, rel=0.02)
    # B=256 touches every expert: all weights but the embedding table, plus 256 x 1024 tokens of latent KV
    every = always + moe_layers * 64 * 2 * expert
    floor = roofline.decode_floor_ms(shape, 256, 1024, kv_token, bandwidth, [64] * moe_layers)
    assert floor == pytest.approx((every + 256 * 1024 * kv_token) / bandwidth * 1e3)
    with pytest.raises(ValueError):
        roofline.decode_weight_bytes(shape, 1, [6])


def test_v3_fp8_weight_shape_counts_fp8_bytes_and_block_scales():
    model, c = meta_model("deepseek-v3", V3_5L)
    shape = roofline.weight_shape(model)
    h, inter = c["hidden_size"], c["moe_intermediate_size"]
    scales = 4 * ((2 * inter // 128) * (h // 128) + (h // 128) * (inter // 128))  # w13 and w2 grids, float32
    assert shape.expert_bytes == [3 * h * inter + scales] * 2
    assert (shape.num_experts, shape.top_k) == (256, 8)
    assert shape.fp8_matmul_params > 8 * 3 * h * inter * 2  # every linear and the top-8 experts are FP8
    assert shape.matmul_params == 2 * 256 * h  # only the two routers (float32) are not
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())


def test_dense_model_floor_is_the_old_rule(tiny_llama_dir):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    with _default_dtype_and_device(torch.bfloat16, torch.device("meta")):
        model = model_class(cfg["architectures"][0])(cfg)
    shape = roofline.weight_shape(model)
    assert shape.moe_layers == 0 and shape.fp8_matmul_params == 0
    assert shape.matmul_params == sum(p.numel() for n, p in model.named_parameters()
                                      if n.startswith("layers.") and n.endswith("proj.weight"))
    embed = model.embed_tokens.weight
    assert shape.always_bytes == sum(p.numel() * 2 for p in model.parameters() if p is not embed)


@pytest.mark.parametrize("cfg", [TINY_V2, dict(TINY_V3, num_nextn_predict_layers=0)], ids=["v2", "v3"])
def test_hf_copy_of_dummy_deepseek_matches_logits(cfg, tmp_path):
    from dsinfer import LLM, SamplingParams

    llm = LLM(str(write_config(tmp_path, cfg)), load_format="dummy", dtype="float32", device="cpu")
    ours = llm.engine.runner.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # unit-scale weights: every tensor visibly shapes the logits
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / (1 if "embed" in name else p.shape[-1]) ** 0.5)
    hf = hf_compare.hf_from_engine(llm, "cpu")
    ids = torch.randint(2, 256, (12,), generator=gen).tolist()
    with torch.no_grad():
        hf_lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    ours_lp = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = torch.stack([hf_lp[i - 1, ids[i]] for i in range(1, len(ids))])
    assert torch.allclose(ours_lp, want, atol=1e-3), (ours_lp - want).abs().max()


def test_latency_steps_run_tiny_deepseek_on_cpu(tmp_path):
    model = write_config(tmp_path / "v3", dict(TINY_V3, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}))
    out = tmp_path / "latency.json"
    overrides = json.dumps({"num_hidden_layers": 4, "first_k_dense_replace": 2, "num_nextn_predict_layers": 0})
    assert main(["bench", "latency", "--device", "cpu", "--dtype", "float32", "--load-format", "dummy", "--model",
                 str(model), "--hf-overrides", overrides, "--batch-sizes", "1", "4", "--context", "32", "--prefill",
                 "16", "2x16", "--steps", "2", "--max-model-len", "128", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["quantization"] == "fp8" and report["num_hidden_layers"] == 4
    one, four = report["decode"]
    assert one["experts_touched"] == 2 and 2 <= four["experts_touched"] <= 8  # top-2 of 8, two MoE layers
    assert 0 < one["floor_ms"] < four["floor_ms"]
    assert one["kv_gb"] == pytest.approx(32 * 4 * (32 + 8) * 4 / 1e9)  # ctx x layers x (latent + rope) x fp32
    assert [p["prefill"] for p in report["prefill"]] == ["16", "2x16"]


def test_throughput_compares_tiny_deepseek_with_hf_on_cpu(tmp_path):
    model = write_config(tmp_path / "v2", TINY_V2)
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(model), "--load-format", "dummy", "--dtype", "float32",
                 "--device", "cpu", "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--compare-hf",
                 "--hf-num-prompts", "2", "--roofline", "--disable-tqdm", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["hf_num_prompts"] == 2 and report["output_tokens"] == 16
    assert report["identical_outputs"] == 2 and report["mean_common_prefix"] == 4
    assert report["ratio_vs_hf_cpu"] == pytest.approx(report["hf_cpu_s"] / report["dsinfer_subset_cpu_s"])
    # benchmarks/gpu_summary.py (gpu_check.sh's table) reads this JSON
    from benchmarks.gpu_summary import MODELS, rows

    table = rows(MODELS[0], {}, report)
    assert [r[0] for r in table] == ["offline 4x16/4", "vs HF, same 2x16/4", "full run vs HF subset"]
    assert table[0][3].endswith("% of roofline") and table[1][3] == "2/2 same"


def test_hf_copy_handles_per_expert_checkpoint_layout(tmp_path):
    """Older transformers keep one module per expert (``experts.{e}.{gate,up,down}_proj.weight``)."""
    from dsinfer import LLM

    llm = LLM(str(write_config(tmp_path, TINY_V2)), load_format="dummy", dtype="float32", device="cpu")
    ours = llm.engine.runner.model
    experts = ours.layers[1].mlp.experts
    inter = experts.w2.shape[2]
    state = {f"model.layers.1.mlp.experts.{e}.{kind}_proj.weight": torch.empty_like(w)
             for e in range(8) for kind, w in (("gate", experts.w13[0, :inter]), ("up", experts.w13[0, inter:]),
                                               ("down", experts.w2[0]))}
    hf_compare._copy_by_checkpoint_names(ours, state)
    assert torch.equal(state["model.layers.1.mlp.experts.5.gate_proj.weight"], experts.w13[5, :inter])
    assert torch.equal(state["model.layers.1.mlp.experts.5.up_proj.weight"], experts.w13[5, inter:])
    assert torch.equal(state["model.layers.1.mlp.experts.7.down_proj.weight"], experts.w2[7])


def test_v4_flash_slice_floor_counts_the_window_and_the_compressed_entries_read():
    """The 4-layer V4-Flash slice (sliding, CSA, CSA, HCA; window 128, rates 4 / 128, top-512, bf16): a decode step
    reads 127 window keys a layer, HCA every entry, CSA the indexer's key of every entry and 512 entries once
    there are that many."""
    model, cfg = meta_model("deepseek-v4-flash-4l")
    window = 127 * 512
    at_1k = 4 * window + 2 * (256 * 128 + 256 * 512) + 8 * 512
    assert roofline.v4_kv_read_bytes(cfg, 1024, 2) == 2 * at_1k
    at_16k = 4 * window + 2 * (4096 * 128 + 512 * 512) + 128 * 512
    assert roofline.v4_kv_read_bytes(cfg, 16384, 2) == 2 * at_16k
    shape = roofline.weight_shape(model)
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    assert shape.expert_bytes == [2 * 3 * h * inter] * 4 and (shape.num_experts, shape.top_k) == (256, 6)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    skipped = model.embed.weight.numel() * 2 + sum(m.ffn.gate.tid2eid.numel() * 8 for m in model.layers[:1])
    assert shape.always_bytes == total - 4 * 256 * 2 * 3 * h * inter - skipped
    assert shape.matmul_params > 4 * 6 * 3 * h * inter  # the routed top-6, the shared expert, attention
    # prefill: far below dense causal attention over 1k tokens (window 128, 1/4 and 1/128 of the entries)
    dense = 2 * 2 * 512 * 64 * 4 * 1024 * 1025 / 2
    assert 0.1 * dense < roofline.attention_flops(cfg, 1, 1024) < 0.5 * dense


def test_latency_steps_run_tiny_v4_with_spread_dummy_routing_on_cpu(tmp_path):
    """V4 end to end on CPU with dummy weights: a batch of 8 touches about as many of the 32 experts (top-4) as
    uniform routing would (the hash layer's table and the learned routers alike), and the floor counts the V4
    cache reads."""
    transformers = pytest.importorskip("transformers")
    from tests.models.v4_fixture import write_checkpoint

    write_checkpoint(transformers, tmp_path / "v4", n_routed_experts=32, num_experts_per_tok=4)
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--device", "cpu", "--dtype", "float32", "--load-format", "dummy", "--model",
                 str(tmp_path / "v4"), "--batch-sizes", "1", "8", "--context", "40", "--prefill", "16", "--steps",
                 "2", "--max-model-len", "128", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    one, eight = report["decode"]
    assert one["experts_touched"] == 4 and one["experts_touched_min"] == 4
    assert eight["experts_touched_min"] >= 0.6 * eight["experts_expected"]  # 21.3 expected
    cfg = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert eight["kv_gb"] == pytest.approx(8 * roofline.v4_kv_read_bytes(cfg, 40, 4) / 1e9)
    assert report["prefill"][0]["prefill"] == "16"


def test_llama_8b_run_floor_is_its_weights_and_kv_per_step_and_its_flops():
    """Llama-3.1-8B bf16 (8.03B parameters, 525M of them the embedding table): a decode step reads 15.01 GB of
    weights, a token's KV is 128 KiB; two prompts of 1,000 tokens making 3 and 5 tokens, one at a time."""
    model, c = meta_model("llama-3.1-8b")
    shape = roofline.weight_shape(model)
    embed = 128256 * 4096
    assert shape.always_bytes == 2 * (8_030_261_248 - embed)
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q and o, k and v, gate / up / down
    assert (shape.matmul_params, shape.lm_head_params) == (32 * layer, embed)
    kv_token = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
    bandwidth, rate = 4.8e12, 989e12
    floor = roofline.run_floor(shape, c, kv_token, 1000, [3, 5], 1, bandwidth, rate)
    assert floor.decode_steps == 2 + 4  # each request's first token is its prefill's
    # decode steps making tokens 2..n read the KV of 1000 + 1 .. 1000 + n - 1 tokens
    kv = kv_token * ((1001 + 1002) + (1001 + 1002 + 1003 + 1004))
    assert floor.decode_s == pytest.approx((6 * shape.always_bytes + kv) / bandwidth)
    attention = 2 * (128 + 128) * 32 * 32 * 2 * 1000 * 1001 / 2  # QK^T and PV, causal, 32 heads x 32 layers
    flops = 2 * 32 * layer * 2000 + attention + 2 * embed * 2
    assert floor.prefill_flops == pytest.approx(flops) and floor.prefill_s == pytest.approx(flops / rate)
    assert floor.fraction(2 * floor.total_s) == pytest.approx(0.5)
    both = roofline.run_floor(shape, c, kv_token, 1000, [3, 5], 2, bandwidth, rate)  # batched: 4 steps
    assert both.decode_steps == 4 and both.decode_kv_bytes == floor.decode_kv_bytes
    assert both.decode_weight_bytes == 4 * shape.always_bytes


def test_continuous_batching_refills_a_slot_when_a_request_finishes():
    # decode steps needed: 2, 4, 1; two slots: the third joins when the first is done
    assert roofline.decode_batches([3, 5, 2], 2) == [2, 2, 2, 1]
    assert roofline.decode_batches([1, 1], 4) == []  # one token each: all from the prefill
    assert sum(roofline.decode_batches([7, 3, 9, 2, 5], 3)) == 6 + 2 + 8 + 1 + 4
    with pytest.raises(ValueError, match="max_num_seqs"):
        roofline.decode_batches([3], 0)


def test_throughput_reports_the_roofline_of_its_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-prompts", "2",
                 "--input-len", "6", "--output-len-range", "2", "4", "--roofline", "--disable-tqdm",
                 "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["roofline_model"].startswith("model LlamaForCausalLM, 2 layers")
    assert figures["roofline_floor_s"] == pytest.approx(figures["roofline_prefill_floor_s"]
                                                        + figures["roofline_decode_floor_s"])
    assert figures["roofline_fraction"] == pytest.approx(figures["roofline_floor_s"] / figures["elapsed_s"])
    assert 2 * 2 <= figures["output_tokens"] <= 2 * 4
