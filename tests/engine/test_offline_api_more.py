"""More of the offline API as a vLLM script uses it: SamplingParams' vLLM conversions (seed=-1, logprobs=True),
detokenize=False, the model's generation_config as the default SamplingParams, and use_tqdm as a tqdm factory."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from dsinfer import LLM, SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir))


def test_seed_minus_one_means_unseeded_as_in_vllm(tiny_llm):
    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(seed=-1, temperature=1.0, max_tokens=12, ignore_eos=True)
    a, b = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_logprobs_true_means_one_as_in_vllm():
    params = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert params.logprobs == 1 and params.prompt_logprobs == 1


def test_logit_bias_and_repetition_penalty_take_any_finite_value_as_in_vllm(tiny_llm):
    """vLLM's SamplingParams bounds neither (the OpenAI server's request schema does, on its own)."""
    (out,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(logit_bias={9: 500.0}, **GREEDY),
                               use_tqdm=False)
    assert out.outputs[0].token_ids == [9] * 6
    assert SamplingParams(logit_bias={9: -1000.0}, repetition_penalty=150.0).repetition_penalty == 150.0
    for kwargs, match in [(dict(logit_bias={9: math.inf}), "logit_bias value must be finite"),
                          (dict(repetition_penalty=math.inf), "repetition_penalty must be finite")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)


def test_detokenize_false_returns_ids_without_text(smollm2_llm):
    """As vLLM: no text, and logprobs (sample and prompt) carry no decoded_token; the ids are those of a normal
    run. Stop strings need text, so they are a ValueError with detokenize=False."""
    prompt = "The capital of France is"
    kwargs = dict(logprobs=1, prompt_logprobs=1, **GREEDY)
    plain, raw = smollm2_llm.generate([prompt] * 2, [SamplingParams(**kwargs),
                                                      SamplingParams(detokenize=False, **kwargs)], use_tqdm=False)
    assert plain.outputs[0].text and raw.outputs[0].text == ""
    assert raw.outputs[0].token_ids == plain.outputs[0].token_ids
    assert raw.prompt_token_ids == plain.prompt_token_ids and raw.prompt == prompt
    sample = [lp for pos in raw.outputs[0].logprobs for lp in pos.values()]
    prompt_lps = [lp for pos in raw.prompt_logprobs[1:] for lp in pos.values()]
    assert sample and prompt_lps and all(lp.decoded_token is None for lp in sample + prompt_lps)
    for got, want in zip(raw.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys()
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-3)
    # the normal run's decoded tokens were not erased by the other request's
    assert all(lp.decoded_token is not None for pos in plain.outputs[0].logprobs for lp in pos.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["."])
    with pytest.raises(ValueError, match="detokenize must be a bool"):
        SamplingParams(detokenize=0)


def test_generation_config_gives_the_default_sampling_params(tiny_llama_dir, tmp_path):
    """vLLM's generation_config="auto": with no SamplingParams, the model's generation_config.json sets
    temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens), where they differ
    from transformers' defaults (top_k 50 is such a default, so it is not applied). Explicit params are used as
    given."""
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.6, "top_p": 0.9,
                                                              "top_k": 50, "max_new_tokens": 3}))
    llm = LLM(str(model))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, -1, 3)
    assert llm.get_default_sampling_params() is not defaults  # a fresh object a caller may change
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3  # unless EOS came first: the random model's EOS is rare
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5


def test_without_generation_config_the_defaults_are_sampling_params(tiny_llm):
    assert tiny_llm.get_default_sampling_params() == SamplingParams()


def test_use_tqdm_may_be_a_tqdm_factory_as_in_vllm(tiny_llm):
    from tqdm import tqdm

    made = []

    def factory(*args, **kwargs):
        made.append(kwargs)
        return tqdm(*args, **kwargs, disable=True)

    outs = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(**GREEDY), use_tqdm=factory)
    assert len(outs) == 2 and len(made) == 1 and made[0]["total"] == 2


def test_vllms_single_gpu_arguments_are_taken(tiny_llama_dir):
    """``LLM(..., tensor_parallel_size=1, trust_remote_code=True)`` as vLLM scripts write it; ``llm.llm_engine``
    is the engine; a pipeline or data parallel size past 1 is refused before anything loads, naming the argument
    (tensor_parallel_size: tests/distributed)."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True)
    assert llm.llm_engine is llm.engine
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=f"{name}=2: dsinfer has no {name.split('_')[0]} parallelism"):
            LLM(str(tiny_llama_dir), **{name: 2})
    with pytest.raises(ValueError, match="trust_remote_code must be a bool"):
        LLM(str(tiny_llama_dir), trust_remote_code="yes")
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(str(tiny_llama_dir), tensor_paralel_size=1)


def test_numpy_and_torch_token_ids_are_taken(tiny_llm):
    """Ids straight from numpy or torch (a tokenizer's arrays), as vLLM takes them: prompt_token_ids,
    stop_token_ids and allowed_token_ids, each as an array or a list of numpy integers."""
    import numpy as np
    import torch

    plain = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**GREEDY), use_tqdm=False)[0]
    for ids in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7], torch.tensor([5, 6, 7])):
        out = tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY), use_tqdm=False)[0]
        assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].token_ids == plain.outputs[0].token_ids
    params = SamplingParams(stop_token_ids=[np.int64(3)], allowed_token_ids=np.arange(2, 9))
    assert params.stop_token_ids == [3] and params.allowed_token_ids == list(range(2, 9))
    assert all(type(t) is int for t in params.allowed_token_ids)
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
        tiny_llm.generate({"prompt_token_ids": np.array([[5, 6]])}, SamplingParams(**GREEDY), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids=np.float32(3.0))
