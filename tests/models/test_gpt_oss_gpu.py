"""GPT-OSS and the KV cache groups on CUDA: the Triton attention with sinks and windows, per-group block tables,
against transformers on the CPU (float32), and a bfloat16 run close to it."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams

from .hf_reference import hf_greedy, hf_prompt_logprobs
from .test_gpt_oss import NEW_TOKENS, _prompts, checkpoint  # noqa: F401 - the module's checkpoint fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}, {"enable_prefix_caching": True}],
                         ids=["whole", "chunked", "prefix"])
def test_gpt_oss_on_cuda_matches_transformers_in_float32(checkpoint, engine_kwargs):  # noqa: F811
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm, outputs = _generate(path, prompts, dtype="float32", **engine_kwargs)
    assert llm.engine.executor.runner.graphs is None  # eager_only
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    assert _worst_logprob_gap(model, prompts, outputs) < 1e-3


def test_gpt_oss_on_cuda_in_bfloat16_stays_close(checkpoint):  # noqa: F811
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    _, outputs = _generate(path, prompts, dtype="bfloat16")
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    assert _worst_logprob_gap(model, prompts, outputs) < 0.25


def test_deterministic_mode_gives_a_request_the_same_tokens_alone_and_in_a_batch(checkpoint):  # noqa: F811
    path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", deterministic=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == batch[3].outputs[0].token_ids
