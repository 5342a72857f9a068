"""vLLM's ``allowed_token_ids`` and ``bad_words``: sampling never leaves the allowed set, and a bad word's token
sequence never appears in the output (a one-token word is banned outright, a longer one at its last token once
the output ends with the rest), with async scheduling as without."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams


def test_allowed_token_ids_bound_greedy_and_random_sampling(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    allowed = [5, 17, 40]
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [9, 8]}]
    for params in (SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, allowed_token_ids=allowed,
                                  ignore_eos=True)):
        for out in llm.generate(prompts, params, use_tqdm=False):
            for completion in out.outputs:
                assert len(completion.token_ids) == 6 and set(completion.token_ids) <= set(allowed)
    free = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert not set(free[0].outputs[0].token_ids) <= set(allowed)  # the bound is what kept them there


@pytest.mark.parametrize("kwargs, match", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must be >= 0"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a list"),
    (dict(bad_words="word"), "bad_words must be a list"),
    (dict(bad_words=["ok", " "]), "bad_words must be non-empty strings"),
])
def test_bad_allowed_or_bad_words_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_allowed_token_ids_outside_the_vocabulary_and_bad_words_without_tokenizer(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="allowed_token_ids contains 256"):
        llm.generate({"prompt_token_ids": [1]}, SamplingParams(allowed_token_ids=[3, 256]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words need the model's tokenizer"):
        llm.generate({"prompt_token_ids": [1]}, SamplingParams(bad_words=["x"]), use_tqdm=False)


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_never_appear(smollm2_llm, async_scheduling):
    from dsinfer.engine.input_processor import bad_word_token_ids

    llm = smollm2_llm if not async_scheduling else LLM(dtype="float32", async_scheduling=True)
    tok = llm.engine.tokenizer  # bad_word_token_ids takes dsinfer's own Tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "The capital of France is"
    base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # a word of two tokens that the greedy output contains ("answer is"), and its first token's word ("Paris")
    two = next(w for i in range(1, len(base) - 1) if (w := tok.decode(base[i:i + 2]).strip())
               and any(len(s) == 2 and _contains(base, s) for s in bad_word_token_ids(tok, [w])))
    one = tok.decode(base[:1]).strip()
    seqs = bad_word_token_ids(tok, [two, one])
    assert any(len(s) == 1 and s[0] == base[0] for s in seqs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[two, one])
    outs = llm.generate([prompt, "Paris is a city in"], params, use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 12 and not any(_contains(ids, s) for s in seqs)
    assert outs[0].outputs[0].token_ids[:1] != base[:1]  # the one-token word was the greedy first token
    # the longer word alone: the output follows the greedy one through the word's first token, then turns
    (seq,) = [s for s in bad_word_token_ids(tok, [two]) if _contains(base, s)]
    at = next(i for i in range(len(base)) if tuple(base[i:i + 2]) == seq)
    only_two = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[two])
    ids = llm.generate(prompt, only_two, use_tqdm=False)[0].outputs[0].token_ids
    assert ids[:at + 1] == base[:at + 1] and ids[at + 1] != base[at + 1] and not _contains(ids, seq)
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=12, ignore_eos=True,
                                                  bad_words=[two, one]), use_tqdm=False)[0]
    assert all(not any(_contains(c.token_ids, s) for s in seqs) for c in sampled.outputs)
    assert llm.engine.scheduler.running == [] and not llm.engine._needs_host_tokens


def test_allowed_tokens_all_banned_by_bad_words_is_a_value_error(smollm2_llm):
    from dsinfer.engine.input_processor import bad_word_token_ids

    ids = [seq[0] for seq in bad_word_token_ids(smollm2_llm.engine.tokenizer, ["Paris"])]
    with pytest.raises(ValueError, match="only tokens that bad_words ban"):
        smollm2_llm.generate("x", SamplingParams(allowed_token_ids=ids, bad_words=["Paris"]), use_tqdm=False)
