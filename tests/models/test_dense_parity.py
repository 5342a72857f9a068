"""Dense models against HF transformers on tiny random checkpoints: prompt logprobs close, greedy tokens equal."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams

from .hf_reference import hf_greedy, hf_prompt_logprobs

transformers = pytest.importorskip("transformers")

NUM_PROMPTS = 8
NEW_TOKENS = 32


def _config(arch: str):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "llama-linear":
        return transformers.LlamaConfig(**common, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        tie_word_embeddings=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=24)
    raise AssertionError(arch)


def _hf_class(arch: str):
    return {
        "llama": transformers.LlamaForCausalLM, "llama-linear": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]


def _randomize_biases(model) -> None:
    # HF initialises biases to zero; random ones make the bias path visible in the comparison.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)


@pytest.fixture(scope="module", params=["llama", "llama-linear", "qwen2", "qwen3", "mistral"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    arch = request.param
    model = _hf_class(arch)(_config(arch)).eval()
    _randomize_biases(model)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    return arch, path, model


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 9, 17, 30, 41, 52, 64, 80]  # past the Mistral window of 24
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths[:NUM_PROMPTS]]


def _run(path, prompts, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_prompt_logprobs_and_greedy_match_transformers(checkpoint):
    arch, path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    outputs = _run(path, prompts)
    worst = 0.0
    for ids, out in zip(prompts, outputs):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        ours = torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])])
        worst = max(worst, (ours - hf_prompt_logprobs(model, ids)).abs().max().item())
        assert out.outputs[0].token_ids == hf_greedy(model, ids, NEW_TOKENS), f"{arch}: greedy continuation differs"
    print(f"{arch}: max |prompt logprob difference| = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 16},  # chunked prefill mixed with decodes
    {"num_kv_blocks": 24, "block_size": 16},  # forces preemption and recompute
])
def test_engine_paths_keep_greedy_tokens(checkpoint, engine_kwargs):
    arch, path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    reference = [o.outputs[0].token_ids for o in _run(path, prompts)]
    assert [o.outputs[0].token_ids for o in _run(path, prompts, **engine_kwargs)] == reference
