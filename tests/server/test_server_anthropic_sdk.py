"""The official anthropic SDK against a live server: messages (streaming and not), tools, count_tokens."""

from __future__ import annotations

import anthropic
import pytest

from .live_server import API_KEY

MESSAGES = [{"role": "user", "content": "Name a color."}]
GREEDY = {"temperature": 0}  # this SDK version has no temperature argument


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def test_message(client):
    m = client.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, messages=MESSAGES, extra_body=GREEDY
    )
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 4


def test_stream_event_sequence_matches_message(client):
    full = client.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=5, messages=MESSAGES, extra_body=GREEDY, system="Be brief."
    )
    with client.messages.stream(
        model="SmolLM2-135M-Instruct", max_tokens=5, messages=MESSAGES, extra_body=GREEDY, system="Be brief."
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens


def test_stop_sequence_reports_it(client):
    m = client.messages.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=16,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count: 1, 2, 3, 4, 5"}],
        stop_sequences=[","],
    )
    if m.stop_reason == "stop_sequence":
        assert m.stop_sequence == ","


def test_tools_and_tool_results_are_accepted(client):
    tools = [
        {
            "name": "get_weather",
            "description": "weather <|im_end|>",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    m = client.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, tools=tools, messages=messages, extra_body=GREEDY
    )
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens(client):
    r = client.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=MESSAGES)
    assert r.input_tokens > 3


def test_errors_use_the_anthropic_envelope(client, server):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=0, messages=MESSAGES)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=2, messages=MESSAGES)
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=MESSAGES)
    assert err.value.body["error"]["type"] == "authentication_error"


TOOLS = [
    {"name": "get_weather", "description": "Weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                      "required": ["city"]}},
    {"name": "get_time", "description": "Time in a zone",
     "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                      "required": ["zone"]}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _forced_use(m, name: str | None) -> None:
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m
    assert uses[0].name == name if name else uses[0].name in ("get_weather", "get_time")
    key = "city" if uses[0].name == "get_weather" else "zone"
    assert set(uses[0].input) == {key} and isinstance(uses[0].input[key], str)


@pytest.mark.parametrize("choice, name", [({"type": "any"}, None), ({"type": "tool", "name": "get_time"}, "get_time")])
def test_tool_choice_any_or_named_forces_one_tool_use(client, choice, name):
    """"any" (a call to some tool) and "tool" (that one), as OpenAI's "required" and a named function."""
    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=80, tools=TOOLS, tool_choice=choice, messages=ASK,
                  extra_body=GREEDY)
    _forced_use(client.messages.create(**kwargs), name)
    with client.messages.stream(**kwargs) as stream:
        _forced_use(stream.get_final_message(), name)


def test_tool_choice_of_an_unknown_tool_is_400(client):
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=8, tools=TOOLS, messages=ASK,
                               tool_choice={"type": "tool", "name": "get_stock"})


def test_tool_choice_any_without_tools_is_400(client):
    with pytest.raises(anthropic.BadRequestError, match="no tools"):
        client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=8, messages=ASK, tool_choice={"type": "any"})


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}]}]},
    {"messages": [{"role": "system", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    {"messages": [USER], "tool_choice": {"type": "any"}},
    {"messages": [USER], "tools": [{"name": "f"}], "tool_choice": {"type": "tool"}},
    {"messages": [USER], "tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": "g"}},
    {"messages": [USER], "tools": [{"name": "f", "input_schema": {"type": "nope"}}], "tool_choice": {"type": "any"}},
    {"messages": [USER], "system": [{"type": "text", "text": ""}]},
    {"messages": [USER], "system": [{"type": "text", "text": " \n"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "  "}]}]},
    {"messages": [USER], "thinking": {"type": "enabled"}},
    {"messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 1023}},
])
def test_count_tokens_refuses_what_messages_refuses(server, body):
    """count_tokens takes a /v1/messages request without max_tokens and refuses it with the same error."""
    body = {"model": "SmolLM2-135M-Instruct", **body}
    counted = server.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 400, counted.text
    # the same error; each body carries its own request_id
    assert counted.json()["error"] == server.post("/v1/messages", json={**body, "max_tokens": 4}).json()["error"]
    assert counted.json()["error"]["type"] == "invalid_request_error"


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_output_config_format_constrains_the_answer_to_the_schema(client):
    """Anthropic's structured outputs (``output_config.format``), through the SDK's own parameter, streamed and
    not: the text is JSON the schema accepts."""
    import json

    import jsonschema

    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=60, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Describe a person as JSON."}],
                  output_config={"format": {"type": "json_schema", "schema": PERSON}, "effort": "low"})
    whole = client.messages.create(**kwargs)
    jsonschema.validate(json.loads(whole.content[0].text), PERSON)
    with client.messages.stream(**kwargs) as stream:
        assert stream.get_final_text() == whole.content[0].text


@pytest.mark.parametrize("output_config, param", [
    ({"format": {"type": "json_object", "schema": {}}}, "output_config.format.type"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
    ({"format": {"type": "json_schema", "json_schema": PERSON}}, "output_config.format.schema"),  # not its name
    ({"format": {"type": "json_schema", "schema": {"type": "nope"}}}, "output_config.format"),
    ({"effort": "extreme"}, "output_config.effort"),
])
def test_output_config_errors_name_the_field(server, output_config, param):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [USER], "output_config": output_config}
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        r = server.post(path, json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert param in r.json()["error"]["message"], r.text


def test_output_config_with_a_forced_tool_lets_the_tool_win(server):
    """As response_format beside a forced tool on the OpenAI route: the call leaves no text to shape."""
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 80, "messages": [USER], "tools": TOOLS,
            "tool_choice": {"type": "any"}, "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}
    r = server.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.json()["content"][-1]["type"] == "tool_use", r.text


@pytest.mark.parametrize("messages, param, words", [
    ([USER, {"role": "assistant", "content": "Sure "}], "messages.1.content", "trailing whitespace"),
    ([USER, {"role": "assistant", "content": [{"type": "text", "text": "Sure\n"}]}], "messages.1.content",
     "trailing whitespace"),
    ([USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {}},
                                              {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon"}]}],
     "messages.1.content.1", "ids must be unique"),
])
def test_anthropic_refuses_what_its_api_refuses(server, messages, param, words):
    """A final assistant prefill ending in whitespace, a tool_use id twice in a turn: Anthropic's 400s."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "tools": TOOLS}
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        r = server.post(path, json={**body, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["message"].startswith(param), r.text
    ok = [USER, {"role": "assistant", "content": "Sure"}]  # no trailing whitespace: a prefill to continue
    assert server.post("/v1/messages", json={**body, "messages": ok, "max_tokens": 4}).status_code == 200


def test_thinking_budget_must_be_below_max_tokens(server):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [USER],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = server.post("/v1/messages", json={**body, "max_tokens": 1024})
    assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"], r.text
    assert server.post("/v1/messages/count_tokens", json=body).status_code == 200  # no max_tokens to compare


def test_count_tokens_counts_a_valid_request_without_max_tokens(server):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [USER, {"role": "assistant", "content": "Hel"}],
            "system": "Be brief.", "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}}
    counted = server.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > server.post("/v1/messages/count_tokens",
                                                        json={**body, "tools": None, "tool_choice": None}
                                                        ).json()["input_tokens"]


def test_stream_keeps_leading_whitespace(client):
    """After a prefill the answer starts with blank lines: the streamed text equals the non-streamed one."""
    messages = [{"role": "user", "content": "List three fruits."}, {"role": "assistant", "content": "Here is a list:"}]
    m = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=12, messages=messages, extra_body=GREEDY)
    with client.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=12, messages=messages,
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in m.content]


def test_block_writer_holds_whitespace_until_text_or_drops_it_before_a_tool_call():
    from dsinfer.protocol.chat_output import OutputDelta
    from dsinfer.protocol.tool_parsers import ParsedToolCall
    from dsinfer.server.anthropic_messages import _BlockWriter

    def texts(events):  # the text deltas' text
        return [e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and "text" in e["delta"]]

    writer = _BlockWriter()
    assert writer.write(OutputDelta(content="\n\n")) == []
    assert texts(writer.write(OutputDelta(content="* Banana"))) == ["\n\n* Banana"]
    writer = _BlockWriter()
    writer.write(OutputDelta(content=" \n"))
    events = writer.write(OutputDelta(tool_calls=[ParsedToolCall("get_time", '{"zone": "UTC"}')]))
    assert not texts(events) and events[0]["content_block"]["type"] == "tool_use" and writer.index == 0
    writer = _BlockWriter()
    writer.write(OutputDelta(content="\n"))
    assert texts(writer.open_only_text()) == ["\n"]  # an answer of whitespace alone: one text block holding it


def test_tool_use_input_with_a_lone_surrogate_escape_encodes():
    """Arguments text may escape a lone surrogate (a DeepSeek call's, a string "arguments"): ``input`` has U+FFFD."""
    from dsinfer.protocol.chat_output import OutputDelta
    from dsinfer.protocol.tool_parsers import ParsedToolCall
    from dsinfer.server.anthropic_messages import _blocks

    (block,) = _blocks(OutputDelta(tool_calls=[ParsedToolCall("get_time", '{"zone": "U\\ud800TC"}')]))
    assert block["input"] == {"zone": "U\ufffdTC"}


def test_empty_message_content_is_400_except_a_final_assistant_prefill(client):
    cases = [
        [{"role": "user", "content": ""}],
        [{"role": "user", "content": []}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "Bye"}],
        [{"role": "user", "content": [{"type": "text", "text": ""}]}],
        [{"role": "user", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}]}],
    ]
    for messages in cases:
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=messages)
        assert err.value.body["error"]["type"] == "invalid_request_error", messages
    m = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])
    assert m.stop_reason in ("max_tokens", "end_turn")


def test_float_fields_refuse_strings_and_booleans(server):
    for value in ("0.5", True):
        r = server.post("/v1/messages", json={"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
                                              "messages": MESSAGES, "temperature": value})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        r = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "top_p": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
    r = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 1})
    assert r.status_code == 200, r.text


def test_assistant_prefill_is_continued(client, server):
    """A final assistant turn is a prefill: the prompt ends with its text (no end of turn, no new turn) and the
    answer continues it; the OpenAI API does the same with continue_final_message (same prompt, same greedy
    tokens) and /tokenize counts that prompt."""
    messages = [{"role": "user", "content": "List three fruits."},
                {"role": "assistant", "content": "Sure! 1. Banana 2."}]
    m = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=6, messages=messages, extra_body=GREEDY)
    tokenized = server.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert tokenized["count"] == prompt
    closed = server.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert closed["tokens"][: tokenized["count"]] == tokenized["tokens"] and closed["count"] > tokenized["count"]
    r = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                  "continue_final_message": True}).json()
    assert r["usage"]["prompt_tokens"] == prompt
    assert r["choices"][0]["message"]["content"] == m.content[0].text


def test_usage_splits_the_prompt_into_fresh_and_cached_tokens(client):
    """Anthropic's usage: input_tokens + cache_read_input_tokens is the prompt; a repeat of the same prompt reads
    its whole blocks from the prefix cache, in the streamed message_start as in the final message."""
    ask = [{"role": "user", "content": "Name three colors of the rainbow, then three animals of the forest."}]
    first = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=ask, extra_body=GREEDY)
    prompt = client.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=ask).input_tokens
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == prompt
    again = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, messages=ask, extra_body=GREEDY)
    cached = again.usage.cache_read_input_tokens
    assert cached >= 16 and again.usage.input_tokens == prompt - cached
    with client.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=2, messages=ask, extra_body=GREEDY) as s:
        events = list(s)
    start = next(e for e in events if e.type == "message_start").message.usage
    assert start.cache_read_input_tokens == again.usage.cache_read_input_tokens
    assert start.input_tokens == again.usage.input_tokens and start.output_tokens == 0
