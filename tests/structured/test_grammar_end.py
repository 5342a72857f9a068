"""How a request with a grammar ends, as in vLLM: once the grammar is complete its mask allows only EOS, the model
samples it, and the EOS id ends ``token_ids`` (with its logprob), not ``text``; finish_reason "stop", stop_reason
None. The grammar's end wins over min_tokens and ignore_eos. The same with and without async scheduling."""

from __future__ import annotations

import json

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.engine.sampling_params import RequestOutputKind
from dsinfer.sampling.sampler import Sampler, SamplingBatch

from .schemas import SCHEMAS

pytest.importorskip("xgrammar")

PROMPTS = ["Is 'I love it' positive or negative?", "A person as JSON.", "Write a year."]
CONSTRAINTS = [{"choice": ["positive", "negative"]}, {"json": SCHEMAS["person"], "disable_any_whitespace": True},
               {"regex": "[12][0-9]{3}"}]


def _chat(llm, prompts, params):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def assert_ends_on_eos(llm, completion, logprobs: bool = True) -> None:
    eos = llm.engine.eos_token_ids
    tok = llm.engine.tokenizer
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] in eos and not eos & set(completion.token_ids[:-1])
    assert completion.text == tok.decode(completion.token_ids[:-1])
    if logprobs:
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(t in pos for t, pos in zip(completion.token_ids, completion.logprobs))
        total = sum(pos[t].logprob for t, pos in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_completed_grammars_end_with_the_eos_token_id(smollm2_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=64, logprobs=2, structured_outputs=c) for c in CONSTRAINTS]
    outputs = _chat(smollm2_llm, PROMPTS, params)
    for out in outputs:
        assert_ends_on_eos(smollm2_llm, out.outputs[0])
    assert outputs[0].outputs[0].text in ("positive", "negative")
    json.loads(outputs[1].outputs[0].text)


def test_n_samples_each_end_with_eos_also_streamed(smollm2_llm):
    params = SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=16, logprobs=0,
                            structured_outputs={"regex": "[0-9]{1,6}"})
    out = _chat(smollm2_llm, ["Pick a number."], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert_ends_on_eos(smollm2_llm, completion)
    engine = smollm2_llm.engine
    delta = SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=16, logprobs=0, output_kind=RequestOutputKind.DELTA,
                           structured_outputs={"regex": "[0-9]{1,6}"})
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Pick a number."}])
    engine.add_request("grammar-end-delta", {"prompt": prompt, "prompt_token_ids": engine.tokenizer.encode(prompt)},
                       delta)
    streamed = [[[], [], ""] for _ in range(3)]
    while engine.has_unfinished_requests():
        for step_out in engine.step():
            for c in step_out.outputs:
                streamed[c.index][0] += c.token_ids
                streamed[c.index][1] += c.logprobs
                streamed[c.index][2] += c.text
    assert [(ids, len(lps), text) for ids, lps, text in streamed] == [
        (c.token_ids, len(c.token_ids), c.text) for c in out.outputs]


@pytest.mark.parametrize("extra", [dict(min_tokens=10), dict(ignore_eos=True), dict(min_tokens=10, ignore_eos=True)])
def test_the_grammar_end_wins_over_min_tokens_and_ignore_eos(smollm2_llm, extra):
    choice = {"choice": ["yes", "no"]}
    plain = _chat(smollm2_llm, ["Yes or no?"], SamplingParams(temperature=0.0, max_tokens=20, logprobs=1,
                                                              structured_outputs=choice))[0].outputs[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1, skip_special_tokens=False,
                            structured_outputs=choice, **extra)
    got = _chat(smollm2_llm, ["Yes or no?"], params)[0].outputs[0]
    assert len(got.token_ids) < 10 and got.token_ids == plain.token_ids
    assert_ends_on_eos(smollm2_llm, got)
    assert got.text in ("yes", "no")  # the ending EOS is a stop token: its text is left out


def test_min_tokens_holds_eos_back_while_the_grammar_may_go_on(smollm2_llm):
    regex = {"regex": "[0-9]{1,4}"}  # SmolLM2 writes one digit per token
    for min_tokens, digits in ((3, (3, 4)), (10, (4,))):
        params = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=12, min_tokens=min_tokens,
                                structured_outputs=regex)
        for got in _chat(smollm2_llm, ["Say 7."], params)[0].outputs:
            assert_ends_on_eos(smollm2_llm, got, logprobs=False)
            assert len(got.text) in digits and len(got.token_ids) == len(got.text) + 1, got.text


def test_max_tokens_reached_as_the_grammar_completes_is_length(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs={"choice": ["yes", "no"]})
    got = _chat(smollm2_llm, ["Yes or no?"], params)[0].outputs[0]
    assert got.finish_reason == "length" and got.text in ("yes", "no") and len(got.token_ids) == 1


def test_async_scheduling_ends_grammars_the_same(smollm2_llm):
    overlapped = LLM(dtype="float32", async_scheduling=True)
    assert overlapped.engine.async_scheduling
    prompts = PROMPTS + ["Tell me a story.", "Count to five."]
    params = [SamplingParams(temperature=0.0, max_tokens=48, logprobs=1, structured_outputs=c) for c in CONSTRAINTS]
    params += [SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)] * 2
    expected = _chat(smollm2_llm, prompts, params)
    got = _chat(overlapped, prompts, params)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (e.outputs[0].finish_reason, None)
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
    for out in got[:3]:
        assert_ends_on_eos(overlapped, out.outputs[0])
    assert not overlapped.engine.has_unfinished_requests() and not overlapped.engine._needs_host_tokens
    # the engine returns to overlapped steps once the grammars are done: a plain request after them
    again = overlapped.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    reference = smollm2_llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids


def test_sampler_bans_yield_only_where_they_would_leave_a_grammar_nothing():
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 2  # row 0: the grammar allows only token 2 (EOS), which row 0 bans (min_tokens)
    bitmask[1, 0] = (1 << 2) | (1 << 5)  # row 1: tokens 2 and 5; 2 banned, so 5
    bitmask[2] = -1  # row 2: unconstrained; its ban holds
    banned = torch.zeros(3, vocab, dtype=torch.bool)
    banned[:, 2] = True
    banned[2, :] = True
    banned[2, 7] = False
    batch = SamplingBatch(temperature=torch.zeros(3), top_k=torch.full((3,), vocab), top_p=torch.ones(3),
                          min_p=torch.zeros(3), seeds=torch.zeros(3, dtype=torch.int64),
                          positions=torch.zeros(3, dtype=torch.int64), all_greedy=True, use_top_k=False,
                          max_top_k=vocab, use_top_p=False, use_min_p=False, banned=banned, token_bitmask=bitmask)
    assert Sampler()(logits, batch).token_ids.tolist() == [2, 5, 7]
