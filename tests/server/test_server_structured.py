"""Structured outputs over the wire: response_format, vLLM's guided_* fields, and 400s for invalid constraints."""

from __future__ import annotations

import json
import re

import pytest

from .test_server_bad_inputs import check_bad

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Give me a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _content(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_response_format_json_schema_output_validates(server):
    jsonschema = pytest.importorskip("jsonschema")
    body = {"messages": MSGS, "max_tokens": 60, "temperature": 0.7, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    jsonschema.validate(json.loads(_content(server.post(CHAT, json=body))), SCHEMA)


def test_guided_choice_and_regex(server):
    body = {"messages": MSGS, "max_tokens": 8, "temperature": 0.7, "guided_choice": ["yes", "no"]}
    assert _content(server.post(CHAT, json=body)) in ("yes", "no")
    body = {"messages": MSGS, "max_tokens": 12, "temperature": 0.7, "guided_regex": r"[0-9]{3}-[a-z]{2}"}
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _content(server.post(CHAT, json=body)))


def test_completions_take_structured_outputs(server):
    body = {"prompt": "The answer is", "max_tokens": 8, "temperature": 0.7,
            "structured_outputs": {"choice": ["A", "B", "C"]}}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("A", "B", "C")


def test_a_lark_grammar_is_taken_as_vllm_takes_it(server):
    lark = 'start: DIGIT ~ 3 "-" WORD\n%import common.DIGIT\n%import common.LCASE_LETTER -> WORD'
    body = {"messages": MSGS, "max_tokens": 12, "temperature": 0.7, "guided_grammar": lark}
    assert re.fullmatch(r"[0-9]{3}-[a-z]", _content(server.post(CHAT, json=body)))
    body = {"prompt": "Code:", "max_tokens": 12, "temperature": 0.7, "structured_outputs": {"grammar": lark}}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200 and re.fullmatch(r"[0-9]{3}-[a-z]", r.json()["choices"][0]["text"]), r.text


@pytest.mark.parametrize("field, value", [
    ("guided_regex", "(unclosed"),
    ("guided_grammar", "root ::= "),
    ("guided_grammar", "start: NUMBER"),  # Lark: NUMBER is not imported
    ("guided_json", {"type": "nope"}),
    ("guided_json", "{not json"),
    ("structured_outputs", {"regex": "[z-a]"}),
    ("structured_outputs", {"json": {"type": "object"}, "regex": "a"}),
])
def test_invalid_constraints_are_400(server, field, value):
    error = check_bad(server, CHAT, 400, {"messages": MSGS, "max_tokens": 4, field: value}, param=field)
    assert ".cc:" not in error["message"] and "/project/" not in error["message"]  # no library source paths


# a schema xgrammar parses but refuses while compiling: that failure was in the engine's step, and killed the engine
COMPILE_ONLY_INVALID = {"type": "object", "properties": {"name": {"type": "string", "minLength": -1}}}


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "p", "schema": COMPILE_ONLY_INVALID}}}),
    (CHAT, {"messages": MSGS, "tool_choice": "required", "stream": True, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": COMPILE_ONLY_INVALID}}]}),
    ("/v1/completions", {"prompt": "Hi", "guided_json": COMPILE_ONLY_INVALID}),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "p",
                                                          "schema": COMPILE_ONLY_INVALID}}}),
    ("/v1/messages", {"model": "SmolLM2-135M-Instruct", "messages": MSGS, "tool_choice": {"type": "any"},
                      "tools": [{"name": "f", "input_schema": COMPILE_ONLY_INVALID}]}),
])
def test_schema_that_fails_only_to_compile_is_400_and_the_engine_lives(server, path, body):
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    error = check_bad(server, path, 400, {**body, limit: 4})  # check_bad also sees a concurrent request served
    assert "repetition range" in error["message"] and ".cc:" not in error["message"], error


def test_two_constraint_sources_are_400(server):
    body = {"messages": MSGS, "max_tokens": 4, "guided_regex": "a+", "response_format": {"type": "json_object"}}
    check_bad(server, CHAT, 400, body, param="guided_regex")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_choice_yields_a_valid_call(server, tool_choice):
    jsonschema = pytest.importorskip("jsonschema")
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 48,
            "temperature": 0.7, "seed": 1}
    r = server.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    # a named function is answered "stop", as OpenAI and vLLM; "required" (the model chose the tool) "tool_calls"
    assert calls and choice["finish_reason"] == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    wanted = ["get_weather"] if isinstance(tool_choice, dict) else ["get_weather", "get_time"]
    assert calls[0]["function"]["name"] in wanted
    schema = WEATHER["function"]["parameters"] if calls[0]["function"]["name"] == "get_weather" else {}
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)


def test_named_tool_choice_must_exist(server):
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 8,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    check_bad(server, CHAT, 400, body, param="tool_choice")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_without_tools_is_400(server, tool_choice):
    body = {"messages": ASK, "max_tokens": 8, "tool_choice": tool_choice}
    assert "no tools" in check_bad(server, CHAT, 400, body, param="tool_choice")["message"]
