"""The offline API as a vLLM user writes it: vLLM's SamplingParams fields (truncate_prompt_tokens,
spaces_between_special_tokens), CompletionOutput.finished(), and ValueErrors for prompts of the wrong type."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_truncate_prompt_tokens_keeps_the_last_tokens(smollm2_llm):
    text = "The quick brown fox jumps over the lazy dog. The capital of France is"
    ids = smollm2_llm.get_tokenizer().encode(text)
    (got,) = smollm2_llm.generate(text, SamplingParams(truncate_prompt_tokens=5, logprobs=0, **GREEDY),
                                  use_tqdm=False)
    (direct,) = smollm2_llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(logprobs=0, **GREEDY),
                                     use_tqdm=False)
    assert got.prompt == text and got.prompt_token_ids == ids[-5:]  # the text as given, the ids as run
    assert got.outputs[0].token_ids == direct.outputs[0].token_ids
    (longer,) = smollm2_llm.generate(text, SamplingParams(truncate_prompt_tokens=len(ids) + 10, **GREEDY),
                                     use_tqdm=False)
    assert longer.prompt_token_ids == ids


def test_truncate_prompt_tokens_minus_one_fits_the_context(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=64, dtype="float32")
    prompt = {"prompt_token_ids": list(range(3, 103))}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)
    (out,) = llm.generate(prompt, SamplingParams(truncate_prompt_tokens=-1, **GREEDY), use_tqdm=False)
    assert out.prompt_token_ids == list(range(40, 103))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, match", [
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens"),
    (dict(spaces_between_special_tokens=1), "spaces_between_special_tokens"),
])
def test_vllm_fields_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_spaces_between_special_tokens_is_accepted_as_in_vllm_fast_detokenizer(smollm2_llm):
    params = [SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=s, **GREEDY)
              for s in (True, False)]
    a, b = smollm2_llm.generate(["<|im_start|>user"] * 2, params, use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text


def test_completion_finished_is_a_method_as_in_vllm(smollm2_llm):
    (out,) = smollm2_llm.generate("Hello", SamplingParams(**GREEDY), use_tqdm=False)
    assert out.finished and out.outputs[0].finished() is True


@pytest.mark.parametrize("prompts", [5, None, 2.5, b"Hello"])
def test_prompts_of_the_wrong_type_are_value_errors(smollm2_llm, prompts):
    with pytest.raises(ValueError, match="prompts must be"):
        smollm2_llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)


def test_streamed_choices_report_their_finish_once(smollm2_llm):
    """DELTA outputs of n > 1: a choice that stops before its siblings is in one output with its finish_reason and
    in none after it (vLLM's streaming); the deltas add up to the whole answer."""
    from dsinfer.engine.sampling_params import RequestOutputKind

    engine = smollm2_llm.engine
    params = dict(n=3, max_tokens=25, temperature=0.9, seed=1, stop=["."])  # choices end after 19, 7 and 25 tokens
    (whole,) = smollm2_llm.generate("Once upon a time", SamplingParams(**params), use_tqdm=False)
    engine.add_request("stream-n3", "Once upon a time", SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    texts, ends, step = ["", "", ""], [[], [], []], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert not ends[c.index], f"choice {c.index} reported after its finish"
                texts[c.index] += c.text
                if c.finish_reason is not None:
                    ends[c.index].append(step)
        step += 1
    assert all(len(e) == 1 for e in ends) and len({e[0] for e in ends}) > 1, ends
    assert texts == [c.text for c in sorted(whole.outputs, key=lambda c: c.index)]
