"""Anthropic Messages API request validation that the real API does and the SDK relies on: each content block's
required fields, tool definitions, metadata, and the pairing of tool_use and tool_result blocks. Each refusal is a
400 ``invalid_request_error`` on /v1/messages and count_tokens alike."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest
from anthropic.lib.streaming import MessageStream
from anthropic.types import RawMessageStreamEvent

from dsinfer.protocol.anthropic_schemas import MessagesRequest
from dsinfer.protocol.chat_output import parse_output
from dsinfer.protocol.tool_parsers import HermesToolParser
from dsinfer.server import anthropic_messages

from .fake_generation import fake_stream
from .live_server import API_KEY

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}
USER = {"role": "user", "content": "Weather in Paris?"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"name": "get_weather", "input_schema": SCHEMA}]
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _refused(client, match: str, **kwargs) -> str:
    """The 400 of /v1/messages (matching ``match``), which count_tokens answers the same."""
    kwargs = {"model": MODEL, "tools": TOOLS, **kwargs}
    with pytest.raises(anthropic.BadRequestError, match=match) as err:
        client.messages.create(max_tokens=2, extra_body=GREEDY, **kwargs)
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    with pytest.raises(anthropic.BadRequestError) as counted:
        client.messages.count_tokens(**kwargs)
    assert counted.value.body["error"] == body["error"]  # each body carries its own request_id
    return body["error"]["message"]


def _accepted(client, **kwargs) -> None:
    kwargs = {"model": MODEL, "tools": TOOLS, **kwargs}
    m = client.messages.create(max_tokens=2, extra_body=GREEDY, **kwargs)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert client.messages.count_tokens(**kwargs).input_tokens > 0


@pytest.mark.parametrize("role, block, field", [
    ("user", {"type": "text"}, "text"),
    ("user", {"type": "text", "text": None}, "text"),
    ("assistant", {"type": "tool_use", "name": "get_weather", "input": {}}, "id"),
    ("assistant", {"type": "tool_use", "id": "toolu_1", "input": {}}, "name"),
    ("assistant", {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}, "input"),
    ("user", {"type": "tool_result", "content": "sunny"}, "tool_use_id"),
])
def test_a_content_block_without_its_required_field_is_400(client, role, block, field):
    """A text block without text was a 500 (the converter read None); a tool_use without id/name/input or a
    tool_result without tool_use_id went into the prompt with empty values. Anthropic requires each (400)."""
    messages = [USER, {"role": role, "content": [block]}]
    if role == "assistant":
        messages.append({"role": "user", "content": [RESULT]})
    message = _refused(client, field, messages=messages)
    assert message.startswith(f"messages.1.content.0: {block['type']} block"), message


def test_tool_names_must_be_unique(client):
    tools = [TOOLS[0], {**TOOLS[0], "description": "again"}]
    assert "unique" in _refused(client, "tools", tools=tools, messages=[USER])


@pytest.mark.parametrize("tool, match", [
    ({"name": "get_weather"}, "tools.0.input_schema: Field required"),
    ({"name": "get_weather", "input_schema": None}, "tools.0.input_schema: Field required"),
    ({"name": "get_weather", "input_schema": {"type": "string"}}, "tools.0.input_schema"),
    ({"name": "get_weather", "input_schema": {"properties": {}}}, "tools.0.input_schema"),
])
def test_a_custom_tool_needs_an_object_input_schema(client, tool, match):
    """``input_schema`` is required and its type is "object", as Anthropic's API (the SDK's ToolParam)."""
    _refused(client, match, tools=[tool], messages=[USER])


def test_a_custom_tool_typed_custom_is_accepted(client):
    _accepted(client, tools=[{**TOOLS[0], "type": "custom"}], messages=[USER])


@pytest.mark.parametrize("metadata", [{"user_id": 5}, {"user_id": "x" * 257}, "user-1"])
def test_metadata_user_id_is_a_short_string(client, metadata):
    with pytest.raises(anthropic.BadRequestError, match="metadata") as err:
        client.messages.create(model=MODEL, max_tokens=2, messages=[USER], metadata=metadata)
    assert err.value.body["error"]["type"] == "invalid_request_error"


def test_metadata_with_a_user_id_or_null_is_accepted(client):
    for metadata in ({"user_id": "8c1f0d9e"}, {"user_id": None}, {}):
        m = client.messages.create(model=MODEL, max_tokens=2, messages=[USER], metadata=metadata, extra_body=GREEDY)
        assert m.type == "message"


def test_tool_use_needs_its_tool_result_in_the_next_message(client):
    messages = [USER, {"role": "assistant", "content": [USE]}, {"role": "user", "content": "and Rome?"}]
    message = _refused(client, "toolu_1", messages=messages)
    assert message.startswith("messages.1: `tool_use` ids were found without `tool_result` blocks"), message
    # one call of two answered
    two = [USE, {**USE, "id": "toolu_2"}]
    message = _refused(client, "toolu_2", messages=[USER, {"role": "assistant", "content": two},
                                                    {"role": "user", "content": [RESULT]}])
    assert "toolu_1" not in message


def test_tool_result_needs_a_tool_use_in_the_previous_message(client):
    message = _refused(client, "unexpected `tool_use_id`", messages=[{"role": "user", "content": [RESULT]}])
    assert message.startswith("messages.0.content.0:") and "toolu_1" in message
    wrong = [USER, {"role": "assistant", "content": [USE]},
             {"role": "user", "content": [RESULT, {**RESULT, "tool_use_id": "toolu_9"}]}]
    message = _refused(client, "toolu_9", messages=wrong)
    assert message.startswith("messages.2.content.1:"), message


def test_tool_results_come_before_text_in_their_message(client):
    """Anthropic refuses text ahead of the tool results; the converter put the results first, so the model read
    the turn in another order than the one sent."""
    messages = [USER, {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [{"type": "text", "text": "Here:"}, RESULT]}]
    assert _refused(client, "tool_result", messages=messages).startswith("messages.2.content.1:")


def test_well_paired_tool_turns_are_accepted(client):
    """Results first then text; an assistant turn split in two messages (Anthropic joins consecutive turns of a
    role)."""
    text_after = [USER, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, USE]},
                  {"role": "user", "content": [RESULT, {"type": "text", "text": "And Rome?"}]}]
    split = [USER, {"role": "assistant", "content": "Checking."}, {"role": "assistant", "content": [USE]},
             {"role": "user", "content": [RESULT]}, {"role": "user", "content": "Thanks"}]
    for messages in (text_after, split):
        _accepted(client, messages=messages)


def _sdk_final_message_of(pieces: list[str]):
    """The streamed events for a generation arriving in ``pieces`` (a reasoning, Hermes-tools server), rebuilt by
    the SDK's stream helper, and the non-streamed answer's blocks for the same text."""
    kwargs = {"reasoning": True, "tool_parser": HermesToolParser}

    async def collect() -> list[str]:
        ctx, gen, outputs = fake_stream(pieces, "msg_1", MODEL)
        req = MessagesRequest(model=MODEL, max_tokens=8, messages=[USER], stream=True)
        return [e async for e in anthropic_messages._stream(ctx, req, gen, outputs, kwargs)]

    sse = "".join(asyncio.run(collect())).encode()
    request = httpx.Request("POST", "http://127.0.0.1/v1/messages")
    response = httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"}, request=request)
    sdk = anthropic.Anthropic(api_key=API_KEY, base_url="http://127.0.0.1")
    stream = MessageStream(anthropic.Stream(cast_to=RawMessageStreamEvent, response=response, client=sdk),
                           anthropic.NOT_GIVEN)
    return stream.get_final_message(), anthropic_messages._blocks(parse_output("".join(pieces), **kwargs))


def test_streamed_tool_input_with_a_lone_surrogate_escape_parses_in_the_sdk():
    """String "arguments" may escape a lone surrogate: the non-streamed input has U+FFFD, but the streamed
    input_json_delta passed the escape on and the SDK's stream helper raised on it (its JSON parser refuses it)."""
    call = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"U\\\\ud800TC\\"}"}\n</tool_call>'
    final, blocks = _sdk_final_message_of(["<think>UTC?</think>", call])
    assert [b.type for b in final.content] == [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert final.content[1].input == blocks[1]["input"] == {"zone": "U\ufffdTC"}
    assert final.content[0].thinking == blocks[0]["thinking"] == "UTC?"
    assert final.stop_reason == "tool_use"


def test_tool_names_of_up_to_128_characters_are_accepted(client):
    """Anthropic takes 128 (an MCP client's "mcp__server__tool" names run long); they were refused past 64."""
    name = "mcp__" + "x" * 123
    tools = [{"name": name, "input_schema": SCHEMA}]
    _accepted(client, tools=tools, tool_choice={"type": "tool", "name": name}, messages=[USER])
    _refused(client, "tools.0.name", tools=[{"name": name + "x", "input_schema": SCHEMA}], messages=[USER])


def test_a_refusal_of_the_message_converter_names_the_block(client):
    """Anthropic's envelope has no ``param``: the message leads with the path of the offending block, as the
    schema's own refusals do."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    message = _refused(client, "not supported", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, image]}])
    assert message.startswith("messages.0.content.1: "), message
