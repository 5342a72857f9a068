"""A preset first token (``LLMEngine.add_request(first_token=...)``, the P/D decode step): its output comes out
of the next step before anything is computed, and decoding continues from it as from a sampled token."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.engine.sampling_params import RequestOutputKind

PROMPT = {"prompt_token_ids": [11, 12, 13, 14, 15]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **kwargs)


def _run(llm, first_token: int, params: SamplingParams) -> list:
    engine = llm.engine
    engine.add_request("r", PROMPT, params, first_token=first_token)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_decoding_continues_from_the_preset_token_as_from_its_own_sample(llm):
    reference = llm.generate(PROMPT, _greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    outputs = _run(llm, reference[0], _greedy(6, output_kind=RequestOutputKind.DELTA))
    assert outputs[0].outputs[0].token_ids == [reference[0]]  # alone: no step ran before it
    assert [t for o in outputs for t in o.outputs[0].token_ids] == reference
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_a_preset_token_other_than_the_greedy_one_is_continued(llm):
    reference = llm.generate(PROMPT, _greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    other = (reference[0] + 1) % llm.engine.model_config.vocab_size
    forced = llm.generate({"prompt_token_ids": PROMPT["prompt_token_ids"] + [other]}, _greedy(3),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert _run(llm, other, _greedy(4))[-1].outputs[0].token_ids == [other, *forced]


def test_a_preset_stop_token_or_max_tokens_1_finishes_without_a_step(llm):
    stop = llm.engine.scheduler  # nothing may be scheduled for it
    out = _run(llm, 7, _greedy(1))
    assert len(out) == 1 and out[0].finished and out[0].outputs[0].token_ids == [7]
    out = _run(llm, 7, SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[7], detokenize=False))
    assert len(out) == 1 and out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == 7
    assert not stop.running and not stop.waiting


@pytest.mark.parametrize(("token", "params", "message"), [
    (-1, _greedy(3), "first_token must be a token id"),
    (10**9, _greedy(3), "first_token must be a token id"),
    (5, _greedy(3, n=2), "needs n=1"),
    (5, _greedy(3, logprobs=1), "no logprobs"),
])
def test_a_preset_token_that_cannot_stand_for_the_first_sample_is_refused(llm, token, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", PROMPT, params, first_token=token)
    assert not llm.engine.has_unfinished_requests()
