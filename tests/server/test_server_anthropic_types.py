"""Anthropic answers validated strictly against the installed anthropic SDK's types, as a strict client reads them
(the SDK's own client builds its objects without validation): the raw message body, each raw streamed event, the
count_tokens body and the error envelopes; and the SDK's stream helper rebuilding the non-streamed answer."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import BaseModel, TypeAdapter

from dsinfer.protocol.anthropic_schemas import MessagesRequest
from dsinfer.protocol.tool_parsers import HermesToolParser
from dsinfer.server import anthropic_messages

from .fake_generation import anthropic_final_message, fake_stream

MODEL = "SmolLM2-135M-Instruct"
EVENT = TypeAdapter(RawMessageStreamEvent)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                           "required": ["city"]}}]
CASES = {
    "plain": dict(max_tokens=20, messages=[{"role": "user", "content": "Name a color."}]),
    "system": dict(max_tokens=20, messages=[{"role": "user", "content": "Name a color."}], system="Be brief."),
    "max_tokens": dict(max_tokens=3, messages=[{"role": "user", "content": "Tell me a story."}]),
    "stop_sequence": dict(max_tokens=16, messages=[{"role": "user", "content": "Name a color."}],
                          stop_sequences=["color"]),
    "tools auto": dict(max_tokens=30, messages=ASK, tools=TOOLS),
    "tools any": dict(max_tokens=60, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}),
    "tools tool": dict(max_tokens=60, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}),
    "tools none": dict(max_tokens=20, messages=ASK, tools=TOOLS, tool_choice={"type": "none"}),
    "thinking disabled": dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                              thinking={"type": "disabled"}),
}
STOP_REASONS = {"plain": "max_tokens", "max_tokens": "max_tokens", "stop_sequence": "stop_sequence",
                "tools any": "tool_use", "tools tool": "tool_use"}
GREEDY = {"temperature": 0}


def _extras(obj: object, path: str = "$") -> list[str]:
    """The fields of a validated SDK object that its type does not declare (its models allow extras)."""
    if isinstance(obj, BaseModel):
        found = [f"{path}.{k}" for k in obj.model_extra or {}]
        return found + [e for k in type(obj).model_fields for e in _extras(getattr(obj, k), f"{path}.{k}")]
    if isinstance(obj, list):
        return [e for k, x in enumerate(obj) for e in _extras(x, f"{path}[{k}]")]
    return []


def _comparable(message: Message) -> dict:
    """A message without what differs between two requests: its id, tool_use ids, and how much of the prompt the
    prefix cache had (the prompt's size stays)."""
    out = message.model_dump()
    out.pop("id")
    for block in out["content"]:
        block.pop("id", None)
    usage = out["usage"]
    usage["prompt"] = usage.pop("input_tokens") + usage.pop("cache_read_input_tokens")
    return out


def _raw_events(server, body: dict) -> list[dict]:
    r = server.post("/v1/messages", json={**body, "stream": True}, **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["request-id"].startswith("req_"), r.text
    events = []
    for chunk in r.text.strip().split("\n\n"):
        name, data = chunk.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}", chunk
        events.append(payload)
    return events


def _check_order(events: list[dict]) -> None:
    """Anthropic's order: message_start, then each block's start, deltas and stop (indexes 0, 1, ...), then
    message_delta and message_stop; pings anywhere after message_start."""
    kinds = [(e["type"], e.get("index")) for e in events if e["type"] != "ping"]
    assert kinds[0] == ("message_start", None) and kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    index = -1
    for kind, at in kinds[1:-2]:
        if kind == "content_block_start":
            assert at == index + 1, kinds
            index = at
        else:
            assert kind in ("content_block_delta", "content_block_stop") and at == index, kinds
    assert index >= 0 and kinds[-3] == ("content_block_stop", index), kinds


@pytest.mark.parametrize("case", CASES)
def test_message_body_validates_strictly_as_the_sdk_message(claude, case):
    kwargs = {"model": MODEL, **CASES[case]}
    response = claude.messages.with_raw_response.create(**kwargs, extra_body=GREEDY)
    raw = response.http_response.json()
    message = Message.model_validate(raw, strict=True)
    assert not _extras(message) and response.http_response.headers["request-id"].startswith("req_")
    assert set(raw) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert raw["id"].startswith("msg_") and (raw["type"], raw["role"], raw["model"]) == ("message", "assistant", MODEL)
    assert raw["stop_reason"] == STOP_REASONS.get(case, raw["stop_reason"])
    assert (raw["stop_sequence"] is not None) == (raw["stop_reason"] == "stop_sequence")
    if raw["stop_reason"] == "stop_sequence":
        assert raw["stop_sequence"] in kwargs["stop_sequences"]
    assert (raw["stop_reason"] == "tool_use") == any(b["type"] == "tool_use" for b in raw["content"])
    usage = raw["usage"]
    assert set(usage) == {"input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"}
    assert usage["output_tokens"] > 0 and usage["cache_creation_input_tokens"] == 0
    assert all(b["id"].startswith("toolu_") and set(b) == {"type", "id", "name", "input"}
               for b in raw["content"] if b["type"] == "tool_use")
    counted = claude.messages.count_tokens(**{k: v for k, v in kwargs.items()
                                              if k not in ("max_tokens", "stop_sequences")})
    assert counted.input_tokens == usage["input_tokens"] + usage["cache_read_input_tokens"]


@pytest.mark.parametrize("case", CASES)
def test_every_streamed_event_validates_and_the_stream_rebuilds_the_message(claude, server, case):
    kwargs = {"model": MODEL, **CASES[case]}
    events = _raw_events(server, {**kwargs, **GREEDY})
    for event in events:
        if event["type"] != "ping":  # the SDK skips pings: no type of its own
            assert not _extras(EVENT.validate_python(event, strict=True)), event
    _check_order(events)
    full = claude.messages.create(**kwargs, extra_body=GREEDY)
    with claude.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert _comparable(final) == _comparable(full)


def test_count_tokens_body_is_the_sdk_shape(server):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "system": "Be brief."}
    r = server.post("/v1/messages/count_tokens", json=body, **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
    assert set(r.json()) == {"input_tokens"} and MessageTokensCount.model_validate(r.json(), strict=True)


@pytest.mark.parametrize("status, error, exc", [
    (400, "invalid_request_error", anthropic.BadRequestError),
    (401, "authentication_error", anthropic.AuthenticationError),
    (404, "not_found_error", anthropic.NotFoundError),
    (413, "request_too_large", anthropic.ContentTooLargeError),
])
def test_errors_parse_into_the_sdk_exception_with_type_and_request_id(claude, server, status, error, exc):
    client = claude if status != 401 else anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    kwargs = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    if status == 400:
        kwargs["max_tokens"] = 0
    elif status == 404:
        kwargs["model"] = "claude-nope"
    elif status == 413:  # past the default 8 MiB body limit
        kwargs["messages"] = [{"role": "user", "content": "x" * (9 << 20)}]
    with pytest.raises(exc) as err:
        client.messages.create(**kwargs)
    e = err.value
    assert (e.status_code, e.type) == (status, error) and e.request_id.startswith("req_")
    # the body carries the request-id header's value too, as Anthropic's API sends it
    assert set(e.body) == {"type", "error", "request_id"} and e.body["type"] == "error"
    assert e.body["request_id"] == e.request_id
    assert set(e.body["error"]) == {"type", "message"} and e.api_message


def _stream_and_blocks(pieces: list[str]) -> tuple[Message, list[dict], list[dict]]:
    """(the SDK stream helper's message, the raw events, the non-streamed blocks) for a reasoning, Hermes-tools
    generation arriving in ``pieces``."""
    kwargs = {"reasoning": True, "tool_parser": HermesToolParser}

    async def collect() -> list[str]:
        ctx, gen, outputs = fake_stream(pieces, "msg_1", MODEL)
        req = MessagesRequest(model=MODEL, max_tokens=8, messages=ASK, stream=True)
        return [e async for e in anthropic_messages._stream(ctx, req, gen, outputs, kwargs)]

    sse = asyncio.run(collect())
    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in sse]
    blocks = anthropic_messages._blocks(*anthropic_messages._line_deltas("".join(pieces), kwargs))
    return anthropic_final_message(sse), events, blocks


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("pieces", [
    ["<think>", "Paris?", "</think>", "Sure."],
    ["Sure.", CALL, " Done."],
    [CALL, "\n", CALL, " Done."],
    ["<think>hm</think>", CALL],
])
def test_blocks_come_in_the_order_they_were_generated_streamed_or_not(pieces):
    """Text after a tool call follows its tool_use block, as the stream sends it: the non-streamed answer put
    all text before the calls (``Sure. Done.``, tool_use) while the SDK rebuilt (``Sure.``, tool_use, ``Done.``)."""
    final, events, blocks = _stream_and_blocks(pieces)
    for event in events:
        if event["type"] != "ping":
            EVENT.validate_python(event, strict=True)
    _check_order(events)
    streamed = [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in final.content]
    assert streamed == [{k: v for k, v in b.items() if k != "id"} for b in blocks]
    Message.model_validate({"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": blocks,
                            "stop_reason": "end_turn", "stop_sequence": None,
                            "usage": {"input_tokens": 1, "output_tokens": 1}}, strict=True)
    if " Done." in pieces:
        assert [b["type"] for b in blocks][-2:] == ["tool_use", "text"] and blocks[-1]["text"] == " Done."


def test_a_call_announced_in_the_last_token_and_never_completed_opens_no_block():
    """Cut off right after its name: the call's markup is the answer's text. The stream opened an empty tool_use
    block after that text, which the SDK rebuilt as a call with no input that the answer never made."""
    text = '<tool_call>\n{"name": "get_weather", "arg'
    final, events, blocks = _stream_and_blocks([text])
    assert [b.type for b in final.content] == [b["type"] for b in blocks] == ["text"]
    assert final.content[0].text == blocks[0]["text"] == text
    assert not any(e.get("content_block", {}).get("type") == "tool_use" for e in events)
