"""GPT-OSS against transformers on a tiny random checkpoint: sliding / full layers with sinks, YaRN, biased MoE
with the clamped SwiGLU; prompt logprobs within 1e-4 and greedy tokens equal, through the engine's paths."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams

from .hf_reference import hf_greedy, hf_prompt_logprobs, record_preemptions

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16
WINDOW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=512, initializer_range=0.1)
    model = transformers.GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF starts biases at zero and sinks near it: random ones make those paths show
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.1))
        for layer in model.model.layers:  # gate/up values past the clamp limit of 7
            layer.mlp.experts.gate_up_proj.mul_(8.0)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return path, model


_GREEDY: dict[tuple[int, ...], list[int]] = {}


def _greedy(model, ids: list[int]) -> list[int]:
    """HF's greedy continuation of the module's checkpoint, computed once per prompt."""
    key = tuple(ids)
    if key not in _GREEDY:
        _GREEDY[key] = hf_greedy(model, ids, NEW_TOKENS)
    return _GREEDY[key]


def _prompts(vocab: int, lengths=(3, 11, 17, 30, 45, 64)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]  # most past the window


def _run(path, prompts, prompt_logprobs=None, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_layers_alternate_sliding_and_full_attention_with_sinks(checkpoint):
    path, model = checkpoint
    llm = LLM(str(path), dtype="float32")
    layers = llm.engine.executor.runner.model.attention_layers()
    assert [layer.sliding_window for layer in layers] == [WINDOW, None, WINDOW, None]
    torch.testing.assert_close(layers[1].sinks, model.model.layers[1].self_attn.sinks.detach(), rtol=0, atol=0)


def test_prompt_logprobs_and_greedy_match_transformers(checkpoint):
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    _, outputs = _run(path, prompts, prompt_logprobs=0)
    worst = 0.0
    for ids, out in zip(prompts, outputs):
        ours = torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])])
        worst = max(worst, (ours - hf_prompt_logprobs(model, ids)).abs().max().item())
        assert out.outputs[0].token_ids == _greedy(model, ids)
    assert worst < 1e-4, f"max |prompt logprob difference| = {worst:.2e}"


def test_greedy_matches_transformers_generate_with_min_tokens(checkpoint):
    path, model = checkpoint
    ids = _prompts(model.config.vocab_size, (40,))[0]
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    ours = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    hf = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert ours == hf[0, len(ids):].tolist()


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 16},  # chunked prefill mixed with decodes
    {"enable_prefix_caching": True, "block_size": 16},  # the second pass hits the first's blocks
], ids=["chunked", "prefix"])
def test_engine_paths_keep_greedy_tokens(checkpoint, engine_kwargs):
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    reference = [_greedy(model, ids) for ids in prompts]
    llm, outputs = _run(path, prompts, **engine_kwargs)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    if engine_kwargs.get("enable_prefix_caching"):
        shared = [prompts[-1][:48] + ids for ids in prompts[:3]]  # a 48-token prefix cached by the first pass
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        again = llm.generate([{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)
        assert all(o.num_cached_tokens >= 32 for o in again)
        assert [o.outputs[0].token_ids for o in again] == [_greedy(model, p) for p in shared]


def test_preemption_keeps_greedy_tokens(checkpoint):
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    reference = [_greedy(model, ids) for ids in prompts]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16, block_size=16)
    preempted = record_preemptions(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert preempted
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_mxfp4_experts_load_as_transformers_dequantizes_them(checkpoint, tmp_path):
    """The released checkpoints' layout: experts as ``*_blocks`` / ``*_scales`` ([E, out, in / 32, 16] and
    [E, out, in / 32]); HF's model with transformers' dequantization of the same bytes is the reference."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, model = checkpoint
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    reference = transformers.GptOssForCausalLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    for i, layer in enumerate(reference.model.layers):
        for proj, (out_dim, in_dim) in {"gate_up_proj": (128, 64), "down_proj": (64, 64)}.items():
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks = torch.randint(0, 256, (6, out_dim, in_dim // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(120, 126, (6, out_dim, in_dim // 32), generator=gen, dtype=torch.uint8)
            del weights[name]
            weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    for file in path.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"))
    prompts = _prompts(model.config.vocab_size, (9, 40))
    _, outputs = _run(tmp_path, prompts, prompt_logprobs=0)
    for ids, out in zip(prompts, outputs):
        ours = torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])])
        assert (ours - hf_prompt_logprobs(reference, ids)).abs().max().item() < 1e-4
        assert out.outputs[0].token_ids == hf_greedy(reference, ids, NEW_TOKENS)


def test_worker_process_gets_both_groups_block_ids_over_the_wire(checkpoint):
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size, (9, 40))
    llm = LLM(str(path), dtype="float32", distributed_executor_backend="mp", max_num_batched_tokens=16)
    assert llm.engine.kv_manager.windows == (None, WINDOW)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [_greedy(model, ids) for ids in prompts]


def test_a_request_the_groups_cannot_hold_is_refused_not_left_waiting(checkpoint):
    path, model = checkpoint
    llm = LLM(str(path), dtype="float32", num_kv_blocks=10, block_size=16)
    ids = _prompts(model.config.vocab_size, (100,))[0]
    # 140 tokens: 9 blocks in the full group, and in the sliding one the window plus a whole prompt chunk
    with pytest.raises(ValueError, match="needs 18 KV blocks"):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    short = llm.generate([{"prompt_token_ids": ids[:30]}], SamplingParams(max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert len(short[0].outputs[0].token_ids) == 10


def test_gpt_oss_20b_shapes():
    """benchmarks/configs/gpt-oss-20b (the released config, MXFP4 left out: dummy weights) builds 20.9B
    parameters and a full and a 128-token sliding group of 12 layers each."""
    import json
    from pathlib import Path

    from dsinfer.core.kv_cache_spec import kv_cache_groups
    from dsinfer.models.gpt_oss import GptOssForCausalLM

    cfg = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/configs/gpt-oss-20b/config.json").read_text())
    with torch.device("meta"):
        gpt = GptOssForCausalLM(cfg)
    assert 20.8e9 < sum(p.numel() for p in gpt.parameters()) < 21.0e9
    groups = kv_cache_groups([layer.kv_cache_spec(16, torch.bfloat16) for layer in gpt.attention_layers()])
    assert [(g.sliding_window, len(g.layers)) for g in groups] == [(None, 12), (128, 12)]


def test_only_mxfp4_quantization_is_accepted():
    from dsinfer.models.gpt_oss import GptOssForCausalLM

    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, vocab_size=64, sliding_window=8)
    GptOssForCausalLM({**cfg, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="quant_method='fp8' is not supported; supported: 'mxfp4'"):
        GptOssForCausalLM({**cfg, "quantization_config": {"quant_method": "fp8"}})
