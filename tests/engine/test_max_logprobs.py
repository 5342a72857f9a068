"""The engine's max_logprobs (vLLM's ``LLM(max_logprobs=N)`` / ``--max-logprobs``): requests asking for more
logprobs or prompt_logprobs are refused by the engine, naming the field; -1 allows up to the vocabulary size.
SamplingParams alone checks only the shape (and offers vLLM's default limit through ``check_logprobs_limit``)."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.engine.arg_utils import EngineArgs

VOCAB = 256  # the tiny Llama's
PROMPT = {"prompt_token_ids": [1, 2, 3]}


def _generate(llm: LLM, **kwargs):
    params = SamplingParams(max_tokens=2, ignore_eos=True, **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def default_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir))


def test_the_default_limit_is_vllms_20(default_llm):
    assert EngineArgs().max_logprobs == 20 and default_llm.engine.model_config.max_logprobs == 20
    assert len(_generate(default_llm, logprobs=20).outputs[0].logprobs[0]) >= 20
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{field} must be in \[0, 20\] \(the engine's max_logprobs\), got 21"):
            _generate(default_llm, **{field: 21})
    assert not default_llm.engine.has_unfinished_requests()


def test_a_larger_max_logprobs_lets_requests_ask_for_more(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_logprobs=30)
    out = _generate(llm, logprobs=30, prompt_logprobs=25)
    assert all(len(position) in (30, 31) for position in out.outputs[0].logprobs)  # the top 30 (+ the sampled)
    assert all(len(position) in (25, 26) for position in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 30\]"):
        _generate(llm, logprobs=31)


def test_a_smaller_max_logprobs_refuses_what_the_default_allows(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_logprobs=2)
    assert len(_generate(llm, logprobs=2).outputs[0].logprobs[0]) in (2, 3)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 2\]"):
        _generate(llm, prompt_logprobs=3)


def test_minus_one_allows_the_whole_vocabulary(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_logprobs=-1)
    assert llm.engine.model_config.logprobs_limit == VOCAB
    assert len(_generate(llm, logprobs=VOCAB).outputs[0].logprobs[0]) == VOCAB
    with pytest.raises(ValueError, match=rf"logprobs must be in \[0, {VOCAB}\]"):
        _generate(llm, logprobs=VOCAB + 1)
    # vLLM's -1: the whole vocabulary, for logprobs and prompt_logprobs, where the limit allows it
    out = _generate(llm, logprobs=-1, prompt_logprobs=-1)
    assert len(out.outputs[0].logprobs[0]) == VOCAB and len(out.prompt_logprobs[1]) == VOCAB
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        _generate(LLM(str(tiny_llama_dir)), logprobs=-1)


@pytest.mark.parametrize("value", [-2, 1.5, True])
def test_a_bad_max_logprobs_is_refused(tiny_llama_dir, value):
    with pytest.raises(ValueError, match="max_logprobs must be an integer in"):
        LLM(str(tiny_llama_dir), max_logprobs=value)


def test_sampling_params_alone_checks_the_shape_and_vllms_default_limit():
    params = SamplingParams(logprobs=50)  # an engine with max_logprobs >= 50 takes it
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        params.check_logprobs_limit()
    params.check_logprobs_limit(50)
    with pytest.raises(ValueError, match="logprobs must be >= 0, or -1 for the whole vocabulary, got -3"):
        SamplingParams(logprobs=-3)
    params = SamplingParams(logprobs=-1, prompt_logprobs=2)
    assert params.with_vocab_logprobs(100) == params.clone().with_vocab_logprobs(100)
    assert (params.with_vocab_logprobs(100).logprobs, params.logprobs) == (100, -1)  # a copy; the original stays
