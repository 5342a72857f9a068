"""Engine features end to end on a tiny random Llama (and the bundled model where text matters)."""

from __future__ import annotations

import random

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.engine.outputs import Logprob

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
EOS = 2  # the tiny checkpoint's eos_token_id


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(low, high))]}
            for _ in range(count)]


def seeded(count: int, max_tokens: int = 12) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
            for i in range(count)]


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.runner.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in engine.kv_manager.pool.blocks[1:])


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy and seeded outputs of 8 prompts on a plain engine without prefix caching."""
    llm = LLM(str(tiny_llama_dir), enable_prefix_caching=False)
    prompts = random_prompts(8, 20, 60)
    return prompts, token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)), \
        token_ids(llm.generate(prompts, seeded(8), use_tqdm=False))


# ----------------------------------------------------------------- prefix caching, chunking, preemption
def test_prefix_hit_skips_computation_with_identical_output(tiny_llama_dir):
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(64)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(256) for _ in range(10)]} for _ in range(2)]
    uncached = LLM(str(tiny_llama_dir), enable_prefix_caching=False)
    expected = [token_ids(uncached.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    llm = LLM(str(tiny_llama_dir), block_size=16)
    first, second = (llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 48 and second.num_cached_tokens == 64
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == expected
    assert llm.engine.get_stats()["prefix_cache_hits"] == 64
    assert_no_leak(llm)


def test_prefix_shared_within_one_batch_matches_uncached(tiny_llama_dir, reference):
    prompts, expected, _ = reference
    head = prompts[0]["prompt_token_ids"]
    shared = [{"prompt_token_ids": head + p["prompt_token_ids"]} for p in prompts[:4]]
    uncached_llm = LLM(str(tiny_llama_dir), enable_prefix_caching=False)
    uncached = token_ids(uncached_llm.generate(shared, GREEDY, use_tqdm=False))
    llm = LLM(str(tiny_llama_dir))
    outputs = llm.generate(shared, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == uncached
    assert all(out.num_cached_tokens > 0 for out in outputs[1:])
    assert_no_leak(llm)


def test_chunked_prefill_equals_unchunked(tiny_llama_dir, reference):
    prompts, greedy, sampled = reference
    llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=16)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == greedy
    assert token_ids(llm.generate(prompts, seeded(8), use_tqdm=False)) == sampled
    assert_no_leak(llm)


def test_no_chunked_prefill_equals_reference(tiny_llama_dir, reference):
    prompts, greedy, _ = reference
    llm = LLM(str(tiny_llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=64)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == greedy
    assert_no_leak(llm)


def test_preemption_gives_identical_outputs(tiny_llama_dir, reference):
    prompts, greedy, sampled = reference
    # 15 usable blocks of 16 tokens for 8 requests of up to 72 tokens: they cannot all stay resident
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, block_size=16, max_model_len=128)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == greedy
    after_greedy = llm.engine.get_stats()["num_preemptions"]
    assert after_greedy > 0
    assert token_ids(llm.generate(prompts, seeded(8), use_tqdm=False)) == sampled
    assert llm.engine.get_stats()["num_preemptions"] > after_greedy
    assert_no_leak(llm)


def test_request_that_can_never_fit_the_kv_cache_is_rejected(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=4, block_size=16, max_model_len=128)
    with pytest.raises(ValueError, match="needs 7 KV blocks"):
        llm.generate({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=40), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": list(range(30))}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    assert_no_leak(llm)


def test_abort_mid_run_frees_all_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(4, 20, 40, seed=3)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.num_free_blocks < engine.runner.num_blocks - 1
    engine.abort_request(["0", "2"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert {rid: out.outputs[0].finish_reason for rid, out in finished.items()} == \
        {"0": "abort", "1": "length", "2": "abort", "3": "length"}
    assert len(finished["0"].outputs[0].token_ids) == 3 and len(finished["1"].outputs[0].token_ids) == 50
    assert_no_leak(llm)


def test_abort_of_waiting_and_unknown_requests(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("run", {"prompt_token_ids": [1, 2, 3]}, params)
    engine.add_request("wait", {"prompt_token_ids": [4, 5, 6]}, params)
    engine.step()
    engine.abort_request(["wait", "no-such-request", "run"])
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["run", "wait"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outputs)
    assert_no_leak(llm)


# ----------------------------------------------------------------- sampling params
def test_n_returns_n_outputs_with_consecutive_seeds(tiny_llm):
    prompt = {"prompt_token_ids": list(range(10, 30))}
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    (out,) = tiny_llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i, ignore_eos=True) for i in range(3)]
    alone = [tiny_llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids for p in singles]
    assert [c.token_ids for c in out.outputs] == alone
    assert len({tuple(t) for t in alone}) == 3
    assert_no_leak(tiny_llm)


def test_unseeded_n_gives_distinct_samples(tiny_llm):
    params = SamplingParams(n=4, max_tokens=8, ignore_eos=True)
    (out,) = tiny_llm.generate({"prompt_token_ids": [7] * 12}, params, use_tqdm=False)
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_max_tokens_finishes_with_length(tiny_llm):
    (out,) = tiny_llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, ignore_eos=True),
                               use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None


def test_stop_token_ids_and_min_tokens(tiny_llm):
    prompt = {"prompt_token_ids": list(range(40, 60))}
    free = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    stop = free[2]
    first = free.index(stop)
    (out,) = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop],
                                                      ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == free[:first + 1]  # the stop token is returned, then generation ends
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    (held,) = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop],
                                                       min_tokens=first + 3, ignore_eos=True), use_tqdm=False)
    tokens = held.outputs[0].token_ids
    assert len(tokens) >= first + 3 and stop not in tokens[:first + 2]
    assert held.outputs[0].finish_reason == ("stop" if tokens[-1] == stop else "length")


def test_stop_strings_count_once_the_output_passes_min_tokens(smollm2_llm):
    """vLLM's detokenizer searches for stop strings once the output is longer than min_tokens: the text of a
    token at position min_tokens (1-based) does not stop it, one token later it does."""
    llm, prompt = smollm2_llm, "The capital of France is"
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    pieces = [llm.get_tokenizer().decode(free.token_ids[: k + 1]) for k in range(len(free.token_ids))]
    texts = [b[len(a):] for a, b in zip([""] + pieces, pieces)]
    k = next(k for k in range(2, len(texts)) if texts[k].strip() and texts[k] not in "".join(texts[:k]))
    stop = texts[k]  # first written by token k + 1 (1-based)

    def run(min_tokens):
        return llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
                                                   min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]

    early = run(k)  # output of k + 1 tokens > min_tokens: stops there
    assert early.finish_reason == "stop" and len(early.token_ids) == k + 1 and early.text == "".join(texts[:k])
    held = run(k + 1)  # the stop string's token is at position min_tokens: not searched
    assert len(held.token_ids) > k + 1 and held.text.startswith("".join(texts[: k + 1]))


def test_ignore_eos(tiny_llm):
    prompt = {"prompt_token_ids": [9, 8, 7]}
    force_eos = {EOS: 100.0}
    (stopped,) = tiny_llm.generate(prompt, SamplingParams(max_tokens=6, logit_bias=force_eos), use_tqdm=False)
    assert stopped.outputs[0].token_ids == [EOS]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    params = SamplingParams(max_tokens=6, logit_bias=force_eos, ignore_eos=True)
    (ignored,) = tiny_llm.generate(prompt, params, use_tqdm=False)
    assert ignored.outputs[0].token_ids == [EOS] * 6 and ignored.outputs[0].finish_reason == "length"
    (held,) = tiny_llm.generate(prompt, SamplingParams(max_tokens=6, logit_bias=force_eos, min_tokens=3),
                                use_tqdm=False)
    assert EOS not in held.outputs[0].token_ids[:3] and held.outputs[0].token_ids[3] == EOS
    assert len(held.outputs[0].token_ids) == 4


def test_logprobs_are_shaped_like_vllm(tiny_llm):
    prompt = list(range(100, 120))
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    (out,) = tiny_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 5
    total = 0.0
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and 3 <= len(position) <= 4
        assert all(isinstance(lp, Logprob) and lp.logprob <= 0 and lp.rank >= 1 for lp in position.values())
        top = sorted((lp for tid, lp in position.items() if tid != token or lp.rank <= 3),
                     key=lambda lp: lp.rank)
        assert [lp.rank for lp in top[:3]] == [1, 2, 3]
        assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
        total += position[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for token, position in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert token in position and 2 <= len(position) <= 3


def test_greedy_logprob_rank_is_one(tiny_llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    (out,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    for token, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert list(position) == [token] and position[token].rank == 1


def test_use_tqdm_on_and_off_give_the_same_outputs(tiny_llm, capsys):
    prompts = random_prompts(3, 5, 10, seed=7)
    quiet = token_ids(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert "Processed prompts" not in capsys.readouterr().err
    shown = token_ids(tiny_llm.generate(prompts, GREEDY, use_tqdm=True))
    assert "Processed prompts" in capsys.readouterr().err
    assert shown == quiet


# ----------------------------------------------------------------- text (bundled model)
def test_stop_string_is_cut_and_reported(smollm2_llm):
    prompt = "The capital of France is"
    free = smollm2_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert "\n" in text, text
    params = SamplingParams(max_tokens=16, temperature=0.0, stop="\n")
    (out,) = smollm2_llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].text == text[:text.index("\n")]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "\n"
    (kept,) = smollm2_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=["\n"],
                                                          include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[:text.index("\n") + 1]
    assert_no_leak(smollm2_llm)


def test_stop_token_text_is_left_out_unless_asked_for(smollm2_llm):
    """A stop token (EOS, or one of stop_token_ids) ends the text without its own text, as vLLM; its id stays in
    token_ids; include_stop_str_in_output keeps the text."""
    tokenizer = smollm2_llm.get_tokenizer()
    comma = tokenizer.encode(",", add_special_tokens=False)[-1]
    prompt = "1, 2, 3, 4, 5, 6,"
    for keep in (False, True):
        params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[comma],
                                include_stop_str_in_output=keep)
        (out,) = smollm2_llm.generate(prompt, params, use_tqdm=False)
        c = out.outputs[0]
        assert c.token_ids[-1] == comma and c.finish_reason == "stop" and c.stop_reason == comma
        assert c.text == tokenizer.decode(c.token_ids if keep else c.token_ids[:-1]), c.text
    question = [{"role": "user", "content": "What is the capital of France?"}]
    eos = tokenizer.eos_token
    for keep in (False, True):
        params = SamplingParams(max_tokens=32, temperature=0.0, skip_special_tokens=False,
                                include_stop_str_in_output=keep)
        (out,) = smollm2_llm.chat(question, params, use_tqdm=False)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None, c.text
        assert c.text.endswith(eos) == keep and "Paris" in c.text, c.text


def test_logprobs_decode_tokens_on_the_bundled_model(smollm2_llm):
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1)
    (out,) = smollm2_llm.generate("The capital of France is", params, use_tqdm=False)
    tokenizer = smollm2_llm.get_tokenizer()
    for token, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert position[token].rank == 1
        assert position[token].decoded_token == tokenizer.decode([token], skip_special_tokens=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert "".join(out.outputs[0].logprobs[i][t].decoded_token
                   for i, t in enumerate(out.outputs[0].token_ids)) == out.outputs[0].text


def test_block_size_defaults_to_64_for_mla_on_cuda_only():
    """MLA models on CUDA get 64-token KV blocks (the TMA decode kernel's tiles lie inside one block); everything
    else, and any explicit block size, is left alone."""
    import torch

    from dsinfer.engine.arg_utils import _resolve_block_size

    mla, mha = {"kv_lora_rank": 512}, {"num_key_value_heads": 8}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _resolve_block_size(None, mla, cuda) == 64
    assert _resolve_block_size(None, mla, cpu) == 16
    assert _resolve_block_size(None, mha, cuda) == 16
    assert _resolve_block_size(32, mla, cuda) == 32


def test_chat_takes_text_content_parts_and_generate_takes_text_prompts(smollm2_llm):
    """vLLM's forms: OpenAI content parts in LLM.chat (joined by newlines, as vLLM), {"prompt": text} in
    LLM.generate; same tokens as the plain string. A non-text part is a ValueError."""
    greedy = SamplingParams(temperature=0, max_tokens=4)
    plain = smollm2_llm.chat([{"role": "user", "content": "Name a\ncolor."}], greedy, use_tqdm=False)[0]
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "color."}]
    (split,) = smollm2_llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False)
    assert split.prompt_token_ids == plain.prompt_token_ids and split.outputs[0].text == plain.outputs[0].text
    with pytest.raises(ValueError, match="content parts"):
        smollm2_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
    (a,), (b,) = (smollm2_llm.generate(p, greedy, use_tqdm=False) for p in ("Paris is", {"prompt": "Paris is"}))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.prompt == "Paris is"


def test_chat_takes_tools_and_continues_a_final_assistant_message(smollm2_llm):
    """vLLM's ``tools=`` and ``continue_final_message``: the tools reach the prompt, a prefill is continued (the
    prompt ends with its text, no new turn), a special-token string typed by the user stays text."""
    greedy = SamplingParams(temperature=0, max_tokens=3)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {}}}}
    user = {"role": "user", "content": "Weather in Paris?"}
    (with_tools,) = smollm2_llm.chat([user], greedy, use_tqdm=False, tools=[tool])
    assert "get_weather" in with_tools.prompt
    (plain,) = smollm2_llm.chat([user], greedy, use_tqdm=False)
    assert "get_weather" not in plain.prompt
    prefill = [user, {"role": "assistant", "content": "The weather in Paris is"}]
    (cont,) = smollm2_llm.chat(prefill, greedy, use_tqdm=False, continue_final_message=True)
    assert cont.prompt.endswith("The weather in Paris is")
    with pytest.raises(ValueError, match="last assistant message"):
        smollm2_llm.chat([user], greedy, use_tqdm=False, continue_final_message=True)
    end_of_turn = smollm2_llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    (typed,) = smollm2_llm.chat([{"role": "user", "content": "say <|im_end|>"}], greedy, use_tqdm=False)
    assert typed.prompt_token_ids.count(end_of_turn) == plain.prompt_token_ids.count(end_of_turn)


@pytest.mark.parametrize("call, match", [
    (dict(messages="hello"), "messages must be a list"),
    (dict(messages=None), "messages must be a list"),
    (dict(messages=["hello"]), "a conversation must be a list"),
    (dict(messages=[{"role": "user", "content": "hi"}, "x"]), "each message must be a dict"),
    (dict(messages=[{"content": "hi"}]), "each message must be a dict with a string 'role'"),
    (dict(chat_template_kwargs=["x"]), "chat_template_kwargs must be a dict"),
    (dict(tools=[{"type": "function"}]), "each tool must be"),
    (dict(tools={"type": "function"}), "tools must be a list"),
    (dict(tools=[{"type": "function", "function": {"name": 5}}]), "each tool must be"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]),
     "each tool call must be"),
])
def test_chat_rejects_malformed_messages_and_tools_with_value_errors(smollm2_llm, call, match):
    kwargs = dict(messages=[{"role": "user", "content": "hi"}]) | call
    with pytest.raises(ValueError, match=match):
        smollm2_llm.chat(sampling_params=SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)


def test_chat_tool_call_arguments_given_as_a_dict_are_json(smollm2_llm):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    (out,) = smollm2_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert '"arguments": {"city": "Paris"}' in out.prompt


def test_allowed_tokens_that_bans_empty_are_a_value_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))  # eos 2
    with pytest.raises(ValueError, match="only stop tokens, which min_tokens bans"):
        llm.generate({"prompt_token_ids": [1]}, SamplingParams(allowed_token_ids=[2], min_tokens=3),
                     use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": [1]}, SamplingParams(allowed_token_ids=[2, 7], min_tokens=3,
                                                                      max_tokens=4), use_tqdm=False)
    assert out.outputs[0].token_ids[:3] == [7, 7, 7]


def test_final_output_metrics_are_complete(tiny_llama_dir):
    """The finished output carries its finish time, after its first token's; earlier outputs have none."""
    llm = LLM(str(tiny_llama_dir))
    (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True),
                          use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    llm.engine.add_request("streamed", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    assert outputs[-1].finished and outputs[-1].metrics.finished_time is not None
    assert all(o.metrics.finished_time is None for o in outputs[:-1])
