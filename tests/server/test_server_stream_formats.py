"""The streamed wire formats against the official SDKs' helpers: chat tool-call deltas, the Responses event sequence,
Anthropic tool_use blocks; each rebuilt by the SDK as the non-streamed answer. Also ``parallel_tool_calls`` false
(the first call only, as vLLM) and a forced tool choice beside ``response_format`` (the call wins, as vLLM; OpenAI
takes both)."""

from __future__ import annotations

import asyncio
import json

import pytest

from dsinfer.protocol.chat_output import parse_output
from dsinfer.protocol.responses_schemas import ResponsesRequest
from dsinfer.protocol.tool_constraints import ToolSpec, tool_call_constraint
from dsinfer.protocol.tool_parsers import HermesToolParser
from dsinfer.server import openai_responses

from .fake_generation import fake_stream
from .weather_tools import ANTHROPIC_TOOLS, ASK, CHAT_TOOLS, MODEL, PARAMS, RESPONSES_TOOLS

# two calls in the Hermes markup the server parses, forced as the answer's text (tool_choice "auto")
TWO_CALLS = "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
                      for city in ("Paris", "Rome"))
COLOR = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 10}}, "required": ["color"],
         "additionalProperties": False}


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _chat_both(client, **kwargs):
    """The non-streamed message, the SDK's stream helper's final message and the raw streamed tool-call deltas."""
    kwargs = dict(model=MODEL, messages=ASK, tools=CHAT_TOOLS, temperature=0, max_tokens=120, **kwargs)
    full = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [tc for e in stream if e.type == "chunk" for c in e.chunk.choices for tc in c.delta.tool_calls or []]
        final = stream.get_final_completion().choices[0]
    return full, final, deltas


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_chat_forced_call_streams_as_openai_and_rebuilds(client, choice):
    full, final, deltas = _chat_both(client, tool_choice=choice)
    assert _calls(final.message) == _calls(full.message) and len(_calls(full.message)) == 1
    assert final.finish_reason == full.finish_reason and full.message.content is None
    first = deltas[0]  # the call's first delta names it: index, id, type, function.name
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])


@pytest.mark.parametrize("parallel", [True, False])
def test_chat_parallel_tool_calls_false_keeps_the_first_call(client, parallel):
    """Two calls are indexed 0, 1 when streamed; ``parallel_tool_calls`` false keeps the first only (vLLM)."""
    full, final, deltas = _chat_both(client, tool_choice="auto", parallel_tool_calls=parallel,
                                     extra_body={"guided_choice": [TWO_CALLS]})
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})][: 2 if parallel else 1]
    assert _calls(full.message) == _calls(final.message) == expected
    assert sorted({d.index for d in deltas}) == list(range(len(expected)))
    assert full.finish_reason == final.finish_reason == "tool_calls"


def test_parallel_false_drops_later_calls_and_ends_a_strict_auto_answer_after_one():
    parsed = parse_output(TWO_CALLS, tool_parser=HermesToolParser, max_calls=1)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert not parsed.content.strip()
    tools = [ToolSpec("get_weather", PARAMS, strict=True)]
    for parallel in (True, False):
        fmt = tool_call_constraint(tools, "auto", HermesToolParser, parallel=parallel)["structural_tag"]["format"]
        assert fmt["stop_after_first"] is not parallel and fmt["at_least_one"] is False


@pytest.mark.parametrize("stream", [False, True])
def test_chat_forced_call_beside_a_strict_response_format(client, stream):
    """OpenAI takes both (the format shapes a text answer, which a forced call leaves none of); vLLM lets the
    tool's schema win. It was a 400 here."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR, "strict": True}}
    kwargs = dict(tool_choice="required", response_format=fmt)
    if stream:
        _, message, _ = _chat_both(client, **kwargs)
    else:
        message = client.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, temperature=0,
                                              max_tokens=120, **kwargs).choices[0]
    assert [name for name, _ in _calls(message.message)] == ["get_weather"]
    # without tools the same format still constrains the streamed text
    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Name a color as JSON."}],
                                     temperature=0, max_tokens=60, response_format=fmt) as s:
        text = s.get_final_completion().choices[0].message.content
    assert set(json.loads(text)) == {"color"}


def _response_events(client, **kwargs):
    kwargs = dict(model=MODEL, temperature=0, **kwargs)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.id == events[-1].response.id
    assert events[0].response.created_at == events[1].response.created_at == events[-1].response.created_at
    assert events[0].response.usage is None and events[1].response.usage is None  # no tokens yet, as OpenAI
    assert events[-1].response.usage.output_tokens > 0
    return full, events


def test_responses_text_event_sequence_and_helper(client):
    kwargs = dict(input="Name a fruit.", max_output_tokens=40)
    full, events = _response_events(client, **kwargs)
    kinds = [e.type for e in events if e.type != "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{full.status}"]
    assert events[2].item.content == [] and events[3].part.text == ""  # the part is announced once, as OpenAI
    item_id = events[2].item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id} == {events[-1].response.output[0].id}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text
    if full.status == "completed":
        with client.responses.stream(model=MODEL, temperature=0, **kwargs) as stream:
            assert stream.get_final_response().output_text == full.output_text


def test_responses_max_output_tokens_is_incomplete_streamed_and_not(client):
    full, events = _response_events(client, input="Tell me a long story.", max_output_tokens=4)
    assert full.status == events[-1].response.status == "incomplete"
    assert full.incomplete_details.reason == events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].type == "response.incomplete"  # as OpenAI: the event is named after the status
    # the message cut off is "incomplete" too, in the answer and in the stream's item events
    assert full.output[-1].status == events[-1].response.output[-1].status == "incomplete"
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


@pytest.mark.parametrize("text_format", [None, {"type": "json_schema", "name": "c", "schema": COLOR, "strict": True}])
def test_responses_forced_call_events_and_helper(client, text_format):
    kwargs = dict(input="Weather in Paris?", tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=60)
    if text_format:  # the call wins over text.format (it was a 400)
        kwargs["text"] = {"format": text_format}
    full, events = _response_events(client, **kwargs)
    kinds = [e.type for e in events]
    delta = "response.function_call_arguments.delta"
    deltas = kinds.count(delta)  # the arguments stream in pieces
    assert deltas > 2 and kinds[2:] == ["response.output_item.added", *[delta] * deltas,
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.id == done.id
    assert events[-3].arguments == "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    with client.responses.stream(model=MODEL, temperature=0, **kwargs) as stream:
        final = stream.get_final_response()
    for r in (full, final):
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(final.output[0].arguments) == json.loads(full.output[0].arguments)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_stream_matches_message(claude, choice):
    kwargs = dict(model=MODEL, max_tokens=80, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                  extra_body={"temperature": 0})
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (start,) = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    assert start.content_block.id.startswith("toolu_") and start.content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert delta.delta.stop_reason == "tool_use"
    # the second request may read the first one's prompt from the prefix cache: the same prompt, split
    # differently between input_tokens and cache_read_input_tokens
    strip = {"id": True, "content": {"__all__": {"id"}}, "usage": {"cache_read_input_tokens", "input_tokens"}}
    assert final.model_dump(exclude=strip) == full.model_dump(exclude=strip)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == full.usage.input_tokens + (
        full.usage.cache_read_input_tokens or 0)


def _responses_stream_of(pieces: list[str]) -> list[dict]:
    """The Responses events streamed for a generation arriving in ``pieces`` (a reasoning, Hermes-tools server)."""

    async def collect() -> list[str]:
        ctx, gen, outputs = fake_stream(pieces, "resp_1", MODEL)
        kwargs = {"reasoning": True, "tool_parser": HermesToolParser}
        req = ResponsesRequest(input="hi", stream=True)
        return [e async for e in openai_responses._stream(ctx, req, gen, outputs, kwargs)]

    return [json.loads(e.split("\ndata: ", 1)[1]) for e in asyncio.run(collect())]


@pytest.mark.parametrize("pieces, kinds", [
    (["<think>plan", " more</think>", "Hi", " there"], ["reasoning", "message"]),
    (["<think>plan</think>", "\n", TWO_CALLS], ["reasoning", "function_call", "function_call"]),
    (["<think>plan</think>", " "], ["reasoning", "message"]),
    (["\n", TWO_CALLS], ["function_call", "function_call"]),
])
def test_responses_stream_lists_reasoning_as_an_item_in_order(pieces, kinds):
    """Reasoning streams as its own item (reasoning_text events) at the index the final response gives it; the
    output items match the non-streamed answer's (whitespace beside calls makes no message)."""
    events = _responses_stream_of(pieces)
    final = events[-1]["response"]["output"]
    parsed = parse_output("".join(pieces), reasoning=True, tool_parser=HermesToolParser)
    assert [i["type"] for i in final] == [i["type"] for i in openai_responses._items(parsed, [])] == kinds
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["id"]) for e in added] == [(k, i["id"]) for k, i in enumerate(final)]
    for e in events:
        if "item_id" in e:
            assert final[e["output_index"]]["id"] == e["item_id"], e
    if "reasoning" in kinds:
        text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert text == final[0]["content"][0]["text"] == parsed.reasoning
        assert [e["type"] for e in events if e.get("item_id") == final[0]["id"]] == [
            "response.content_part.added", *["response.reasoning_text.delta"] * len(text.split(" ")),
            "response.reasoning_text.done", "response.content_part.done"]
    if "message" in kinds:
        assert final[-1]["content"][0]["text"] == parsed.content
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
