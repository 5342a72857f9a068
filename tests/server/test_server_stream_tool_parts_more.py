"""Streamed tool calls in pieces on /v1/messages and /v1/responses, as Anthropic and OpenAI send them: a tool_use
block (a function_call item) opens as the call is announced, its input (arguments) follows in fragments, and it
closes when the call completes. Fed token-sized pieces through each route's ``_stream`` and rebuilt by the official
SDKs' stream helpers, which must give the non-streamed answer; then against the live server."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from dsinfer.protocol.anthropic_schemas import MessagesRequest
from dsinfer.protocol.chat_output import parse_output
from dsinfer.protocol.responses_schemas import ResponsesRequest
from dsinfer.protocol.tool_parsers import DeepSeekV3ToolParser, HermesToolParser
from dsinfer.server import anthropic_messages, openai_responses

from .fake_generation import anthropic_final_message, fake_stream
from .test_server_stream_tool_call_parts import ARGS, FORMATS, _ds_v31
from .weather_tools import ANTHROPIC_TOOLS, ASK, MODEL, RESPONSES_TOOLS

LEAD = "Let me check. "
CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'  # cut off by max_tokens
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"]}\n</tool_call> Sorry.'  # no JSON


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _sse(stream_fn, req, pieces: list[str], kwargs: dict, finish: str) -> list[str]:
    """A route's streamed events for a generation arriving in ``pieces``, finished with ``finish``."""

    async def collect() -> list[str]:
        ctx, gen, outputs = fake_stream(pieces, "id_1", MODEL)

        async def finished_with() -> object:
            async for out in outputs:
                if out.finished:
                    out.outputs[0].finish_reason = finish
                yield out

        return [e async for e in stream_fn(ctx, req, gen, finished_with(), kwargs)]

    return asyncio.run(collect())


def _anthropic(pieces: list[str], parser=HermesToolParser, finish: str = "stop"):
    """(events, the SDK stream helper's final message, the non-streamed blocks and stop reason) for ``pieces``."""
    kwargs = {"tool_parser": parser}
    req = MessagesRequest(model=MODEL, max_tokens=8, messages=ASK, tools=ANTHROPIC_TOOLS, stream=True)
    sse = _sse(anthropic_messages._stream, req, pieces, kwargs, finish)
    final = anthropic_final_message(sse)
    text = "".join(pieces)
    parsed = parse_output(text, **kwargs)
    completion = type("C", (), {"finish_reason": finish, "stop_reason": None})()
    reason, _ = anthropic_messages._stop_reason(completion, req, bool(parsed.tool_calls))
    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in sse]
    return events, final, anthropic_messages._blocks(parsed), reason


def _block_events(events: list[dict]) -> dict[int, list[dict]]:
    blocks: dict[int, list[dict]] = {}
    for e in events:
        if "index" in e:
            blocks.setdefault(e["index"], []).append(e)
    return blocks


def _without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_anthropic_tool_use_streams_its_input_in_pieces(fmt, size):
    parser, calls_text = FORMATS[fmt]
    events, final, blocks, reason = _anthropic(_pieces(LEAD + calls_text, size), parser)
    # the SDK rebuilds the non-streamed answer: the text, then both calls with the same input
    assert _without_ids([b.model_dump(exclude_none=True) for b in final.content]) == _without_ids(blocks)
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
    assert [b["input"] for b in blocks[1:]] == [json.loads(json.dumps(a)) for a in ARGS]
    assert final.stop_reason == reason == "tool_use"
    for index, (start, *deltas, stop) in _block_events(events).items():
        if index == 0:
            continue
        assert start["content_block"] == {"type": "tool_use", "id": final.content[index].id, "name": "get_weather",
                                          "input": {}}
        assert all(d["delta"]["type"] == "input_json_delta" for d in deltas) and stop["type"] == "content_block_stop"
        assert len(deltas) > 2  # in pieces, not the whole input once the call is complete
        assert json.loads("".join(d["delta"]["partial_json"] for d in deltas)) == blocks[index]["input"]
    # each call's block closes before the next one opens; the text comes first, as it arrived
    assert [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block_s")] == [
        ("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2)]


@pytest.mark.parametrize("string, expected", [
    ("U\\ud800TC", "U\ufffdTC"),  # lone high surrogate: U+FFFD, as the non-streamed input
    ("U\\udc00\\ud800", "U\ufffd\ufffd"),  # lone low, then lone high at the string's end
    ("U\\ud83d\\ude00!", "U\U0001F600!"),  # a pair is a character
    ("U\\\\ud800", "U\\ud800"),  # an escaped backslash before "ud800": no escape at all
])
def test_anthropic_raw_arguments_with_surrogate_escapes_parse_in_the_sdk(string, expected):
    """DeepSeek's arguments are the model's text: a lone surrogate's escape in a fragment would make the SDK's
    stream helper raise. The input streams up to it, and the rest comes whole as the call completes."""
    args = '{"city": "Paris", "days": [1, 2], "zone": "' + string + '", "ok": true}'
    text = "<｜tool▁calls▁begin｜>" + _ds_v31(json.loads(args)).replace(json.dumps(json.loads(args)), args) + \
        "<｜tool▁calls▁end｜>"
    assert args in text
    events, final, blocks, _ = _anthropic(list(text), DeepSeekV3ToolParser)
    assert final.content[0].input == blocks[0]["input"] == {"city": "Paris", "days": [1, 2], "zone": expected,
                                                             "ok": True}
    deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(deltas) > 10 and "".join(deltas).startswith('{"city": "Paris", "days": [1, 2], "zone": "U')


@pytest.mark.parametrize("finish, reason", [("stop", "end_turn"), ("length", "max_tokens")])
@pytest.mark.parametrize("text", [CUT, BROKEN])
def test_anthropic_call_that_never_completes_is_closed_and_its_text_follows(text, finish, reason):
    """Announced once its name is read, a call cut off or whose markup does not parse has its block closed as
    it is; its text follows as a text block (the non-streamed answer's text) and the stop reason is the
    non-streamed one: no call was made."""
    events, final, blocks, expected = _anthropic(_pieces(text, 3), finish=finish)
    assert [b.type for b in final.content] == ["tool_use", "text"] and [b["type"] for b in blocks] == ["text"]
    assert final.content[1].text == blocks[0]["text"] == text
    assert final.stop_reason == expected == reason
    (start, *deltas, stop) = _block_events(events)[0]
    assert start["content_block"]["name"] == "get_weather" and stop["type"] == "content_block_stop" and deltas


def _responses(pieces: list[str], parser=HermesToolParser, finish: str = "stop"):
    """(the events, the final response of the SDK's stream state fed them as its stream parses them, the
    non-streamed items)."""
    kwargs = {"tool_parser": parser}
    req = ResponsesRequest(input="hi", tools=RESPONSES_TOOLS, stream=True)
    sse = _sse(openai_responses._stream, req, pieces, kwargs, finish)
    raw = [json.loads(e.split("\ndata: ", 1)[1]) for e in sse]
    events = [construct_type(type_=ResponseStreamEvent, value=e) for e in raw]
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        state.handle_event(event)
    items, _ = openai_responses.answer_items("".join(pieces), finish, kwargs, [])
    return raw, events[-1].response, items


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_responses_function_call_arguments_stream_in_pieces(fmt, size):
    parser, calls_text = FORMATS[fmt]
    raw, final, items = _responses(_pieces(LEAD + calls_text, size), parser)
    assert [i["type"] for i in items] == [o.type for o in final.output] == ["message", "function_call",
                                                                           "function_call"]
    assert final.output[0].content[0].text == items[0]["content"][0]["text"] == LEAD
    assert [(o.name, o.arguments, o.status) for o in final.output[1:]] == [
        (i["name"], i["arguments"], "completed") for i in items[1:]]
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    for k, item in enumerate(final.output[1:], 1):
        mine = [e for e in raw if e.get("output_index") == k]
        assert [e.get("item_id", e.get("item", {}).get("id")) for e in mine] == [item.id] * len(mine)
        added, *deltas, done, item_done = mine
        assert added["type"] == "response.output_item.added"
        assert added["item"] == {**item.model_dump(exclude_none=True), "arguments": "", "status": "in_progress"}
        assert {e["type"] for e in deltas} == {"response.function_call_arguments.delta"} and len(deltas) > 2
        assert "".join(e["delta"] for e in deltas) == done["arguments"] == item.arguments
        assert done["type"] == "response.function_call_arguments.done"
        assert item_done["type"] == "response.output_item.done" and item_done["item"] == item.model_dump(
            exclude_none=True)
    # the second call is added once the first is done
    kinds = [(e["type"], e.get("output_index")) for e in raw if "output_item" in e["type"]]
    assert kinds == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1),
                     ("response.output_item.added", 2), ("response.output_item.done", 2)]


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("length", "incomplete")])
@pytest.mark.parametrize("text", [CUT, BROKEN])
def test_responses_call_that_never_completes_is_done_incomplete(text, finish, status):
    """A call whose markup ends or breaks before the generation does: its item is done "incomplete" with the
    arguments sent (no arguments.done: they are not whole) and its text follows as a message, the non-streamed
    answer's. Cut off by max_output_tokens instead (``test_responses_call_cut_off_is_an_incomplete_call``), a call
    is only a call."""
    if text == CUT and finish == "length":
        return
    raw, final, items = _responses(_pieces(text, 3), finish=finish)
    assert [i["type"] for i in items] == ["message"] and [o.type for o in final.output] == ["function_call",
                                                                                            "message"]
    assert final.status == status and final.output[1].content[0].text == items[0]["content"][0]["text"] == text
    assert final.output[1].status == items[0]["status"] == status
    call = final.output[0]
    assert call.status == "incomplete" and call.arguments and text.endswith("Par") == (call.arguments[-3:] == "Par")
    assert not any(e["type"] == "response.function_call_arguments.done" for e in raw)
    done = [e for e in raw if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["id"], e["item"]["status"]) for e in done] == [
        (0, call.id, "incomplete"), (1, final.output[1].id, final.output[1].status)]


@pytest.mark.parametrize("lead", ["", LEAD])
def test_responses_call_cut_off_is_an_incomplete_call(lead):
    """max_output_tokens cutting a call short: streamed or not, the answer is that call, "incomplete", with the
    arguments read so far (no message repeating its markup), after any text before it; the response is
    "incomplete" too."""
    raw, final, items = _responses(_pieces(lead + CUT, 3), finish="length")
    assert [(i["type"], i["status"]) for i in items] == [(o.type, o.status) for o in final.output] == (
        [("message", "completed")] if lead else []) + [("function_call", "incomplete")]
    assert final.status == "incomplete" and final.output[-1].arguments == items[-1]["arguments"] == '{"city": "Par'
    assert not any(e["type"] == "response.function_call_arguments.done" for e in raw)


def test_responses_cut_right_after_a_whole_call_keeps_it_completed():
    """The length limit falling just after a call's closing markup: the call is whole ("completed", arguments
    done), streamed or not, and only the response is "incomplete" (a 500 before: no text item to mark)."""
    whole = CUT + 'is"}}\n</tool_call>'
    raw, final, items = _responses(_pieces(whole, 3), finish="length")
    assert [(i["type"], i["status"]) for i in items] == [(o.type, o.status) for o in final.output] == [
        ("function_call", "completed")]
    assert final.status == "incomplete" and final.output[0].arguments == items[0]["arguments"] == '{"city": "Paris"}'
    assert any(e["type"] == "response.function_call_arguments.done" for e in raw)


def test_live_anthropic_forced_tool_use_streams_its_input_in_pieces(claude):
    kwargs = dict(model=MODEL, max_tokens=80, messages=ASK, tools=ANTHROPIC_TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 2 and json.loads("".join(deltas)) == final.content[0].input == full.content[0].input
    assert [e.type for e in events if e.type.startswith("content_block_s")] == ["content_block_start",
                                                                                "content_block_stop"]
    assert final.stop_reason == full.stop_reason == "tool_use"


def test_live_responses_forced_call_streams_its_arguments_in_pieces(client):
    kwargs = dict(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS, tool_choice="required",
                  max_output_tokens=60, temperature=0)
    full = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and "".join(deltas) == final.output[0].arguments == full.output[0].arguments
    assert {e.output_index for e in events if hasattr(e, "output_index")} == {0}


def test_responses_usage_counts_the_reasoning_tokens():
    """``output_tokens_details.reasoning_tokens``: the reasoning item's text, encoded again (here by
    ``fake_stream``'s stand-in tokenizer of one token a word)."""
    req = ResponsesRequest(input="hi", stream=True)
    pieces = ["<think>", "one two", " three", "</think>", "Answer."]

    async def collect() -> list[str]:
        ctx, gen, outputs = fake_stream(pieces, "id_1", MODEL)
        return [e async for e in openai_responses._stream(ctx, req, gen, outputs, {"reasoning": True})]

    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in asyncio.run(collect())]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
