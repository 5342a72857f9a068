"""Answers validated strictly against the official openai SDK's types (``Model.model_validate`` on the raw JSON, each
streamed event against its own event type): the SDK's clients build their objects without validation, so a field
it requires and the server leaves out shows only here (``usage.input_tokens_details.cache_write_tokens`` did)."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from .weather_tools import ASK, RESPONSES_TOOLS

# the SDK's event union, by each event's "type"
EVENT_TYPES = {cls.model_fields["type"].annotation.__args__[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
RESPONSES = {
    "text, cut": {"input": "Hi", "max_output_tokens": 3, "top_logprobs": 2,
                  "include": ["message.output_text.logprobs"]},
    "forced call": {"input": ASK, "max_output_tokens": 60, "temperature": 0, "tools": RESPONSES_TOOLS,
                    "tool_choice": "required"},
    "json schema": {"input": "Give JSON", "max_output_tokens": 30, "temperature": 0,
                    "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}},
}


def _events(server, path: str, body: dict) -> list[dict]:
    r = server.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("name", RESPONSES)
def test_responses_answer_and_every_event_parse_as_the_sdk_types(server, client, model, name):
    body = {"model": model, **RESPONSES[name]}
    raw = client.responses.with_raw_response.create(**body).http_response.json()  # the SDK's own request
    response = Response.model_validate(raw)
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    assert response.usage.input_tokens_details.cached_tokens <= response.usage.input_tokens
    events = _events(server, "/v1/responses", body)
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == f"response.{final.status}" and final.usage.input_tokens_details.cache_write_tokens == 0
    assert [item.type for item in final.output] == [item.type for item in response.output]


def test_responses_sdk_stream_helper_gets_the_completed_response(client, model):
    with client.responses.stream(model=model, **RESPONSES["forced call"]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output[-1].type == "function_call" and final.usage.input_tokens_details.cache_write_tokens == 0


def test_chat_and_completions_parse_as_the_sdk_types(server, model):
    """Their usage details are optional in the SDK: ``prompt_tokens_details`` carries ``cached_tokens`` (as vLLM
    with --enable-prompt-tokens-details), no ``cache_write_tokens``."""
    chat = {"model": model, "messages": ASK, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    answer = ChatCompletion.model_validate(server.post("/v1/chat/completions", json=chat).json())
    assert answer.usage.prompt_tokens_details.cached_tokens <= answer.usage.prompt_tokens
    for chunk in _events(server, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}):
        ChatCompletionChunk.model_validate(chunk)
    completion = {"model": model, "prompt": "Hi", "max_tokens": 3, "logprobs": 1}
    Completion.model_validate(server.post("/v1/completions", json=completion).json())
    for chunk in _events(server, "/v1/completions", completion):
        # the SDK types a stream chunk as a Completion, whose finish_reason has no null; OpenAI (and vLLM) send
        # null until the last chunk, so that one field is checked as the wire has it
        choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        Completion.model_validate({**chunk, "choices": choices})
