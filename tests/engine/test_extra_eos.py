"""A generation_config.json listing several eos_token_ids (Llama 3 instruct: 128001, 128008, 128009): as vLLM, the
tokenizer's eos_token is the EOS (stop_reason None) and the other listed ids are stop tokens (finish_reason "stop",
stop_reason = the id); ignore_eos stops on none of them."""

from __future__ import annotations

import json
import shutil

import pytest

from dsinfer import LLM, SamplingParams

VOCAB = 256
PRIMARY, EXTRA_A, EXTRA_B = 9, 7, 2  # <|eot_id|>-like EOS of the tokenizer, and two more ids the config lists
SPECIAL = {EXTRA_B: "<end_of_text>", EXTRA_A: "<eom>", PRIMARY: "<eot>"}


def _write_tokenizer(path):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(content, special=True) for content in SPECIAL.values()])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL[PRIMARY]}))


def _model(tiny_llama_dir, tmp_path, eos_ids, tokenizer=True):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos_ids}))
    if tokenizer:
        _write_tokenizer(model)
    return model


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return LLM(str(_model(tiny_llama_dir, tmp_path_factory.mktemp("extra_eos"), [EXTRA_B, EXTRA_A, PRIMARY])))


def _forced(llm, token, **kwargs):
    """The output when ``token`` (after ``kwargs['min_tokens']`` other tokens, if any) is the greedy choice."""
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={token: 100.0}, **kwargs)
    return llm.generate({"prompt_token_ids": [11, 12, 13]}, params, use_tqdm=False)[0].outputs[0]


def test_the_tokenizers_eos_is_the_eos(llm):
    assert llm.engine.eos_token_ids == {PRIMARY, EXTRA_A, EXTRA_B}
    assert llm.engine.extra_eos_token_ids == {EXTRA_A, EXTRA_B}
    out = _forced(llm, PRIMARY)
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([PRIMARY], "stop", None, "")


@pytest.mark.parametrize("token", [EXTRA_A, EXTRA_B])
def test_the_other_listed_ids_stop_with_their_id_as_stop_reason(llm, token):
    out = _forced(llm, token)
    # as any stop token: its id ends token_ids, its text is not in the output
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([token], "stop", token, "")
    out = _forced(llm, token, include_stop_str_in_output=True, skip_special_tokens=False)  # WordLevel: " <eom>"
    assert (out.token_ids, out.stop_reason, out.text.strip()) == ([token], token, SPECIAL[token])


@pytest.mark.parametrize("token", [PRIMARY, EXTRA_A, EXTRA_B])
def test_ignore_eos_stops_on_none_of_them(llm, token):
    # vLLM adds the other ids to stop_token_ids only without ignore_eos
    out = _forced(llm, token, ignore_eos=True)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token] * 6, "length", None)


def test_ignore_eos_still_stops_on_an_explicit_stop_token(llm):
    out = _forced(llm, EXTRA_A, ignore_eos=True, stop_token_ids=[EXTRA_A])
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([EXTRA_A], "stop", EXTRA_A)


def test_min_tokens_holds_the_other_ids_back(llm):
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, allowed_token_ids=[EXTRA_A, 40],
                            logit_bias={EXTRA_A: 100.0})
    out = llm.generate({"prompt_token_ids": [11, 12, 13]}, params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([40, 40, 40, EXTRA_A], "stop", EXTRA_A)


def test_a_tokenizer_eos_the_config_does_not_list_is_still_the_eos(tiny_llama_dir, tmp_path):
    llm = LLM(str(_model(tiny_llama_dir, tmp_path, [EXTRA_B, EXTRA_A])))  # vLLM: every listed id a stop token
    assert (llm.engine.eos_token_ids, llm.engine.extra_eos_token_ids) == ({PRIMARY, EXTRA_A, EXTRA_B},
                                                                          {EXTRA_A, EXTRA_B})
    assert (_forced(llm, PRIMARY).stop_reason, _forced(llm, EXTRA_B).stop_reason) == (None, EXTRA_B)


def test_without_a_tokenizer_every_listed_id_is_an_eos(tiny_llama_dir, tmp_path):
    llm = LLM(str(_model(tiny_llama_dir, tmp_path, [EXTRA_B, EXTRA_A], tokenizer=False)))
    for token in (EXTRA_A, EXTRA_B):
        out = _forced(llm, token)
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", None)


@pytest.mark.parametrize("token", [PRIMARY, EXTRA_A, EXTRA_B])
def test_min_tokens_holds_every_eos_id_back_with_ignore_eos_too(llm, token):
    # vLLM's min_tokens bans all_stop_token_ids, which hold the EOS and the extra ids whatever ignore_eos says;
    # past min_tokens ignore_eos lets them through without stopping
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=3, allowed_token_ids=[token, 40],
                            logit_bias={token: 100.0}, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [11, 12, 13]}, params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([40, 40, 40, token, token], "length", None)


def test_min_tokens_with_ignore_eos_and_only_eos_ids_allowed_is_refused(llm):
    with pytest.raises(ValueError, match="only stop tokens, which min_tokens bans"):
        llm.generate({"prompt_token_ids": [11]}, SamplingParams(allowed_token_ids=[EXTRA_A, PRIMARY], min_tokens=2,
                                                                ignore_eos=True), use_tqdm=False)
