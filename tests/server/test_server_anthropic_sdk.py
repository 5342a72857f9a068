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
