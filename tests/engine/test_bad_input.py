"""Bad input fails loudly (ValueError / TypeError / FileNotFoundError naming the field) and harms nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from dsinfer import LLM, SamplingParams

NAN = float("nan")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir))


def serves_a_good_request(llm: LLM) -> bool:
    (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False)
    engine = llm.engine
    return (len(out.outputs[0].token_ids) == 4 and not engine.has_unfinished_requests()
            and engine.kv_manager.num_free_blocks == engine.runner.num_blocks - 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature must be in"),
    (dict(temperature=float("inf")), "temperature must be in"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.01), "top_p must be in"),
    (dict(top_k=-2), "top_k must be -1"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in"),
    (dict(n=0), "n must be in"),
    (dict(stop=5), "stop must be a list"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(ignore_eos="no"), "ignore_eos must be a bool"),
    (dict(skip_special_tokens=1), "skip_special_tokens must be a bool"),
    (dict(output_kind=7), "output_kind must be one of"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(min_tokens=5, max_tokens=3), r"min_tokens \(5\) must be <= max_tokens \(3\)"),
    (dict(logprobs=-2), "logprobs must be >= 0, or -1"),  # the upper bound is the engine's (test_max_logprobs.py)
    (dict(prompt_logprobs=-2), "prompt_logprobs must be >= 0, or -1"),
    (dict(seed=2**64), "seed must fit"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must be >= 0"),
    (dict(logit_bias={-3: 1.0}), "logit_bias must map"),
    (dict(temperature=NAN), "temperature must not be NaN"),
    (dict(top_p=NAN), "top_p must not be NaN"),
    (dict(min_p=NAN), "min_p must not be NaN"),
    (dict(repetition_penalty=NAN), "repetition_penalty must not be NaN"),
    (dict(presence_penalty=NAN), "presence_penalty must not be NaN"),
    (dict(frequency_penalty=NAN), "frequency_penalty must not be NaN"),
    (dict(logit_bias={3: NAN}), "logit_bias value must not be NaN"),
    (dict(n=True), "n must be an integer"),
    (dict(n=2.0), "n must be an integer"),
    (dict(max_tokens="5"), "max_tokens must be an integer"),
    (dict(max_tokens=8.0), "max_tokens must be an integer"),
    (dict(min_tokens=True), "min_tokens must be an integer"),
    (dict(top_k=1.0), "top_k must be an integer"),
    (dict(seed="1"), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(logprobs=False), "logprobs must be an integer"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be an integer"),
    (dict(logit_bias={"3": 1.0}), "logit_bias key must be an integer"),
    (dict(temperature="1"), "temperature must be a number"),
    (dict(top_p=True), "top_p must be a number"),
])
def test_invalid_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_token_ids": [1, 256]}, SamplingParams(), "prompt_token_ids contains 256, outside the vocab"),
    ({"prompt_token_ids": [-1, 5]}, SamplingParams(), r"prompt_token_ids contains -1"),
    ({"prompt_token_ids": [1, 2.0]}, SamplingParams(), "prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": [True]}, SamplingParams(), "prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": []}, SamplingParams(), "the prompt is empty"),
    ({"prompt": 5}, SamplingParams(), "a prompt must be a string, "),
    ("text without a tokenizer", SamplingParams(), "no tokenizer"),
    ({"prompt": "text without a tokenizer"}, SamplingParams(), "no tokenizer"),
    ({"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[999]), "stop_token_ids contains 999"),
    ({"prompt_token_ids": [1]}, SamplingParams(logit_bias={300: 1.0}), "logit_bias contains token id 300"),
    ({"prompt_token_ids": [1] * 512}, SamplingParams(), r"512 tokens; max_model_len is 512"),
    ({"prompt_token_ids": [1] * 600}, SamplingParams(), r"600 tokens; max_model_len is 512"),
])
def test_bad_request_is_rejected_and_the_engine_still_serves(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert serves_a_good_request(llm)


def test_max_tokens_past_the_context_stop_at_the_context(llm):
    """As vLLM offline: prompt + max_tokens over max_model_len (512) is not an error; the output stops at the
    context's end with finish reason "length"."""
    (out,) = llm.generate({"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=20, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
    assert serves_a_good_request(llm)


def test_bad_prompt_inside_a_batch_aborts_the_batch_cleanly(llm):
    prompts = [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 999]}, {"prompt_token_ids": [3]}]
    with pytest.raises(ValueError, match="999"):
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert serves_a_good_request(llm)


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate([{"prompt_token_ids": [1]}] * 3, [SamplingParams()] * 2, use_tqdm=False)
    assert serves_a_good_request(llm)


@pytest.mark.parametrize("params, got", [({"max_tokens": 2}, "got dict"), ("x", "got str"), (5, "got int"),
                                         ([SamplingParams(), {"max_tokens": 2}], "holding dict")])
def test_sampling_params_of_another_type_get_a_type_error(llm, params, got):
    with pytest.raises(TypeError, match=f"sampling_params must be a SamplingParams or a list of them.*{got}"):
        llm.generate([{"prompt_token_ids": [1]}] * 2, params, use_tqdm=False)
    assert serves_a_good_request(llm)


def test_numbers_of_other_types_are_taken_as_ints_and_floats():
    """numpy scalars (a script's np.linspace of temperatures, an np.int64 length), as vLLM takes them."""
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float16(0.5), max_tokens=np.int64(5),
                       top_k=np.int32(3), seed=np.uint8(7), logprobs=np.int64(2), n=np.int8(2))
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k, p.seed, p.logprobs, p.n) == (0.5, 0.5, 5, 3, 7, 2, 2)
    assert type(p.max_tokens) is int and type(p.temperature) is float
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(5.0))


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request("dup", {"prompt_token_ids": [3]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert serves_a_good_request(llm)


def test_request_id_clashing_with_a_sample_of_n_is_rejected(llm):
    """An n > 1 request runs its samples as "<id>#<index>": a request with such an id while they run, or an n > 1
    request whose samples would take a running request's id, is a ValueError (the two used to share one engine
    slot, and the engine spun forever)."""
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=2, seed=0))
    with pytest.raises(ValueError, match="request id 'a#1' is already in use"):
        engine.add_request("a#1", {"prompt_token_ids": [3]}, SamplingParams(max_tokens=2))
    engine.add_request("b#0", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request id 'b' is already in use: its sample 'b#0'"):
        engine.add_request("b", {"prompt_token_ids": [3]}, SamplingParams(n=2, max_tokens=2, seed=0))
    finished = set()
    for _ in range(20):
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == {"a", "b#0"} and not engine.has_unfinished_requests()
    assert serves_a_good_request(llm)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(block_size=0), ValueError, r"block_size must be an integer in \[1, 1024\], got 0"),
    (dict(block_size=12), ValueError, "block_size must be a power of two, got 12"),
    (dict(block_size=16.0), ValueError, "block_size must be an integer"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be an integer"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens must be an integer"),
    (dict(max_model_len=True), ValueError, "max_model_len must be an integer"),
    (dict(max_model_len=4096), ValueError, r"max_model_len=4096 exceeds .* max_position_embeddings \(512\)"),
    (dict(num_kv_blocks=1), ValueError, "num_kv_blocks must be an integer"),
    (dict(kv_cache_memory_gb=-1.0), ValueError, "kv_cache_memory_gb must be > 0"),
    (dict(dtype="int8"), ValueError, "dtype must be 'auto' or one of"),
    (dict(load_format="pickle"), ValueError, "load_format must be one of"),
    (dict(device="tpu"), ValueError, "device must be 'auto', 'cpu' or 'cuda'"),
    (dict(seed="0"), ValueError, "seed must be an integer"),
    (dict(blok_size=16), TypeError, r"unknown argument\(s\) \['blok_size'\]"),
])
def test_bad_engine_arguments_name_the_field(tiny_llama_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(str(tiny_llama_dir), **kwargs)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    model = tmp_path / "foo"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown architecture 'FooForCausalLM'; supported: .*Llama"):
        LLM(str(model))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_llama_dir, tmp_path, damage):
    model = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file" * 4 if damage == "garbage" else data[:len(data) // 2])
    with pytest.raises(ValueError, match="cannot read weights file .*model.safetensors"):
        LLM(str(model))


def test_missing_weights(tiny_llama_dir, tmp_path):
    model = tmp_path / "empty"
    model.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", model / "config.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        LLM(str(model))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_leaves_the_llm_usable(tiny_llama_dir, monkeypatch, async_scheduling, error):
    """Ctrl-C (or an error such as out of memory) in the middle of a step: the call's requests are aborted, their
    KV blocks freed, and the next generate gives what a fresh engine gives (it used to spin forever: the
    scheduler had counted the failed step's tokens as computed)."""
    llm = LLM(str(tiny_llama_dir), async_scheduling=async_scheduling)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (expected,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)
    runner, calls = llm.engine.runner, []
    name = "launch" if async_scheduling else "execute"
    step = getattr(runner, name)

    def failing(sched):
        calls.append(1)
        if len(calls) == 3:  # a few steps in: some requests prefilled, some decoding
            raise error("interrupted")
        return step(sched)

    monkeypatch.setattr(runner, name, failing)
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    with pytest.raises(error):
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4] * 8}] * 4, long, use_tqdm=False)
    monkeypatch.setattr(runner, name, step)
    assert not llm.engine.has_unfinished_requests()
    assert serves_a_good_request(llm)
    (again,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_config_without_architectures_falls_back_to_model_type(tiny_llama_dir, tmp_path):
    """As transformers: a config.json with model_type only is read as that type's architecture; neither, or a
    config.json that is not JSON, is a ValueError naming the file."""
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    del config["architectures"]
    (model / "config.json").write_text(json.dumps(config))
    assert LLM(str(model)).engine.model_config.architecture == "LlamaForCausalLM"
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    with pytest.raises(ValueError, match="config.json names no architectures"):
        LLM(str(model))
    (model / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LLM(str(model))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_interrupted_step_leaves_no_unwritten_blocks_in_the_prefix_cache(tiny_llama_dir, monkeypatch,
                                                                              async_scheduling):
    """The blocks of a step join the prefix cache when it is scheduled; a step that raised before its forward
    never wrote their KV. The same prompt again must be computed afresh, not read from those blocks (it used to
    hit 3 blocks of garbage and give other tokens)."""
    prompt = {"prompt_token_ids": list(range(10, 74))}  # 4 blocks of 16
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (expected,) = LLM(str(tiny_llama_dir), enable_prefix_caching=False).generate(prompt, greedy, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), async_scheduling=async_scheduling)
    runner = llm.engine.runner
    name = "launch" if async_scheduling else "execute"
    step = getattr(runner, name)

    def failing(sched):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, name, failing)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, greedy, use_tqdm=False)
    monkeypatch.setattr(runner, name, step)
    (again,) = llm.generate(prompt, greedy, use_tqdm=False)
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
