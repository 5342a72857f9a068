"""The official openai SDK against a live server: chat, completions, responses, models; streaming and not."""

from __future__ import annotations

import json

import openai
import pytest

from .live_server import MAX_MODEL_LEN

MESSAGES = [{"role": "user", "content": "Name a color."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct"
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"


def test_chat_completion_with_usage(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream_under_greedy(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_n_choices_and_logprobs(client, model):
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, n=3, seed=7, logprobs=True, top_logprobs=2
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for choice in r.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 3
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_seed_makes_sampling_reproducible(client, model):
    def run(seed):
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    first = run(1234)
    assert run(1234) == first


def test_chat_with_tools_is_served(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"


def test_completions_stream_and_not(client, model):
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    assert r.object == "text_completion" and r.usage.prompt_tokens > 0
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_completions_echo(client, model):
    r = client.completions.create(model=model, prompt="One two", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith("One two")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_with_logprobs_scores_the_prompt(client, model, stream):
    """As OpenAI's legacy API: the logprobs cover the echoed prompt (the first token's entries null), then the
    completion's, which are those of the same request without echo."""
    prompt = "The capital of France is"
    kwargs = dict(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    if stream:
        chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
        lp = {k: sum((getattr(c.choices[0].logprobs, k) for c in chunks), []) for k in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        text = "".join(c.choices[0].text for c in chunks)
    else:
        r = client.completions.create(**kwargs)
        lp, text = r.choices[0].logprobs.model_dump(), r.choices[0].text
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    n = len(lp["tokens"]) - 3  # prompt tokens
    assert "".join(lp["tokens"][:n]) == prompt and text == prompt + plain.choices[0].text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) >= 1 for t in lp["top_logprobs"][1:n])
    assert lp["tokens"][n:] == plain.choices[0].logprobs.tokens
    assert lp["text_offset"][n] == len(prompt) and lp["text_offset"][:n] == sorted(lp["text_offset"][:n])


def test_completions_stream_logprob_offsets_match_non_stream_with_a_stop(client, model):
    """With a stop string the stream holds back text that could begin it, but sends every token's logprob: the
    offsets follow the tokens, as without streaming."""
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=10, temperature=0, logprobs=1,
                  stop=["zzzzzzzzzz"])
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs]
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == whole.text_offset
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == whole.tokens


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(client, model):
    """vLLM's ``stop_reason`` beside finish_reason: the stop string or stop token id matched, else null."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    text = plain.choices[0].text
    word = text.split()[1] if len(text.split()) > 1 else text.strip()
    hit = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=[word])
    assert (hit.choices[0].finish_reason, hit.choices[0].stop_reason) == ("stop", word)
    assert plain.choices[0].stop_reason is None
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=[word],
                                            stream=True))
    assert chunks[-1].choices[0].stop_reason == word
    token = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    first = int(token.choices[0].logprobs.tokens[0].split(":")[1])
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"stop_token_ids": [first]})
    via_completions = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                extra_body={"stop_token_ids": [first]})
    assert via_completions.choices[0].stop_reason == first
    streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                   stream=True, extra_body={"stop_token_ids": [first]}))
    assert streamed[-1].choices[0].stop_reason == chat.choices[0].stop_reason


def test_stream_options_need_stream_and_continuous_usage_fills_every_chunk(client, model, server):
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})):
        r = server.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 0
    assert counts[0] == 0 and chunks[0].choices[0].delta.role == "assistant"  # the role's chunk: no token yet
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    plain = list(client.completions.create(model=model, prompt="Hi", max_tokens=3, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_completions_echo_of_a_one_token_prompt_has_its_null_entry(client, model):
    r = client.completions.create(model=model, prompt="The", max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens[0] == "The" and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[:2] == [0, 3]


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                   "required": ["city"]}},
                   {"type": "function", "name": "get_time", "description": "Time in a zone",
                    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                   "required": ["zone"]}}]


@pytest.mark.parametrize("choice, name", [("required", None), ({"type": "function", "name": "get_time"}, "get_time")])
def test_responses_tool_choice_forces_a_call(client, model, choice, name):
    r = client.responses.create(model=model, input="What's the weather in Paris?", tools=RESPONSES_TOOLS,
                                tool_choice=choice, max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    assert calls[0].name == (name or calls[0].name) and calls[0].name in ("get_weather", "get_time")
    assert isinstance(json.loads(calls[0].arguments), dict)
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == name


def test_responses_text_format_json_schema_constrains_the_output(client, model, server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "cat", "schema": schema, "strict": True}
    r = client.responses.create(model=model, input="Describe a cat as JSON with name and age",
                                max_output_tokens=60, temperature=0, text={"format": fmt})
    data = json.loads(r.output_text)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)
    assert r.text.format.type == "json_schema"
    bad = server.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                               "schema": "not a schema"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text
    # chat's response_format shape (the schema under "json_schema") is not this API's: its wrapper object must not
    # become the schema
    chat_style = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    bad = server.post("/v1/responses", json={"input": "hi", "text": {"format": {**chat_style, "name": "x"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text
    bad = server.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_schema",
                                                                               "schema": schema}}})
    assert bad.status_code == 400 and "name" in bad.json()["error"]["message"], bad.text


def test_responses_top_logprobs_score_the_output_text(client, model):
    """Logprobs come with ``include=["message.output_text.logprobs"]``, ``top_logprobs`` alternatives each (0 when
    unset), as OpenAI and vLLM; ``top_logprobs`` alone includes none, and the response repeats it."""
    kwargs = dict(model=model, input="Name a fruit.", max_output_tokens=5, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    r = client.responses.create(**kwargs)
    assert r.top_logprobs == 2
    plain = client.responses.create(**{**kwargs, "include": None})
    assert plain.output[-1].content[0].logprobs == [] and plain.top_logprobs == 2
    bare = client.responses.create(**{**kwargs, "top_logprobs": None})
    assert bare.output[-1].content[0].logprobs and all(lp.top_logprobs == [] for lp in
                                                      bare.output[-1].content[0].logprobs)
    part = r.output[-1].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(lp.logprob <= 0 and 1 <= len(lp.top_logprobs) <= 2 for lp in part.logprobs)
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    # the second request reuses the cached prompt: the same tokens, logprobs equal up to float32 rounding
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(done.logprobs, part.logprobs))


def test_responses_stream_and_not(client, model):
    r = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=5, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.usage.output_tokens <= 5
    events = list(
        client.responses.create(
            model=model, input="Name a fruit.", max_output_tokens=5, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_context_length_error_through_sdk(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_MODEL_LEN)
    assert err.value.status_code == 400
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"


def test_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_truncate_prompt_tokens_keeps_the_prompt_tail(client, server, model):
    """vLLM's field: the engine runs the prompt's last k tokens, and usage counts those (chat and completions)."""
    prompt = "one two three four five six seven eight nine ten"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert full.usage.prompt_tokens > 3 and cut.usage.prompt_tokens == 3
    tail = client.completions.create(model=model, prompt=" eight nine ten", max_tokens=2, temperature=0)
    assert tail.usage.prompt_tokens == 3 and cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for bad in (0, -2, "3"):
        r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
