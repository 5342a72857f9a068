"""GPT-OSS through the Triton kernels: on CUDA (gpu-marked: float32 against transformers on the CPU, bfloat16 close
to it, deterministic mode) and in Triton's CPU interpreter (the attention with sinks and windows over each KV
cache group's block table, against transformers)."""

from __future__ import annotations

import pytest
import torch
import transformers

from dsinfer import LLM, SamplingParams

from .hf_reference import hf_greedy, hf_prompt_logprobs
from .test_gpt_oss import NEW_TOKENS, _prompts, checkpoint  # noqa: F401 - the module's checkpoint fixture

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels run compiled (the gpu tests below)")
def test_triton_interpreter_greedy_matches_hf(checkpoint, monkeypatch):  # noqa: F811
    """Prefill chunks and decode on the Triton attention kernels (TRITON_INTERPRET=1; the other ops on torch, to
    keep the test short): HF's greedy tokens."""
    import dsinfer.ops.attention as attention_op
    import dsinfer.ops.triton.attention as attention_kernels

    monkeypatch.setattr(attention_op, "use_triton", lambda q: True)  # the attention only: the rest stays torch
    calls = {"sinks": 0}
    kernel = attention_kernels.paged_attention_triton

    def counting(*args, **kwargs):
        calls["sinks"] += kwargs.get("sinks") is not None
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "paged_attention_triton", counting)
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size, (9, 40))
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, ids, 8) for ids in prompts]
    assert calls["sinks"] > 0


# ---- CUDA ----


def _generate(path, prompts, **kwargs):
    llm = LLM(str(path), device="cuda", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _worst_logprob_gap(model, prompts, outputs) -> float:
    worst = 0.0
    for ids, out in zip(prompts, outputs):
        ours = torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])])
        worst = max(worst, (ours - hf_prompt_logprobs(model, ids)).abs().max().item())
    return worst


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}, {"enable_prefix_caching": True}],
                         ids=["whole", "chunked", "prefix"])
def test_gpt_oss_on_cuda_matches_transformers_in_float32(checkpoint, engine_kwargs):  # noqa: F811
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm, outputs = _generate(path, prompts, dtype="float32", **engine_kwargs)
    assert llm.engine.executor.runner.graphs is None  # eager_only
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    assert _worst_logprob_gap(model, prompts, outputs) < 1e-3


@pytest.mark.gpu
@gpu
def test_gpt_oss_on_cuda_in_bfloat16_stays_close(checkpoint):  # noqa: F811
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    _, outputs = _generate(path, prompts, dtype="bfloat16")
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    # the checkpoint's clamped, 8x-scaled experts make bfloat16 itself far from float32 (transformers' own bfloat16
    # run: 1.54 nats at worst): ours must be no farther than that, with a margin for rounding in another order
    hf_bf16 = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf_gap = max((hf_prompt_logprobs(hf_bf16, ids).float() - hf_prompt_logprobs(model, ids)).abs().max().item()
                 for ids in prompts)
    assert _worst_logprob_gap(model, prompts, outputs) < max(0.25, 1.25 * hf_gap)


@pytest.mark.gpu
@gpu
def test_deterministic_mode_gives_a_request_the_same_tokens_alone_and_in_a_batch(checkpoint):  # noqa: F811
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", deterministic=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == batch[3].outputs[0].token_ids
