"""A forced tool call (a named ``tool_choice``, "required", Anthropic's "tool" / "any") that ``max_tokens`` cuts
off, on the bundled model (issue 45): ``finish_reason`` "length" with the call and the argument text produced
so far in ``tool_calls``, streamed or not, and never its ``<tool_call>`` markup in ``content`` (which it was
when the cut fell before the call's name was read)."""

from __future__ import annotations

import json

import pytest

from .weather_tools import ANTHROPIC_TOOLS, ASK, CHAT_TOOLS, MODEL

TWO_TOOLS = [*CHAT_TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(server, tool_choice, max_tokens, stream=False, tools=CHAT_TOOLS):
    body = {"messages": ASK, "tools": tools, "tool_choice": tool_choice, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    calls: dict[int, dict] = {}
    for d in deltas:
        for part in d["delta"].get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            call["name"] = part["function"].get("name") or call["name"]
            call["arguments"] += part["function"].get("arguments") or ""
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    return {"finish_reason": deltas[-1]["finish_reason"], "content": content, "calls": list(calls.values())}


@pytest.fixture(scope="module")
def whole_arguments(server) -> str:
    choice = _chat(server, NAMED, 60)
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["tool_calls"][0]["function"]["arguments"]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
@pytest.mark.parametrize("max_tokens", [3, 9, 24])
def test_a_cut_off_forced_call_is_a_call_with_its_arguments_so_far(server, whole_arguments, tool_choice, max_tokens):
    plain = _chat(server, tool_choice, max_tokens)
    assert plain["finish_reason"] == "length" and plain["message"]["content"] in (None, ""), plain
    (call,) = plain["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert whole_arguments.startswith(call["function"]["arguments"])
    streamed = _chat(server, tool_choice, max_tokens, stream=True)
    assert streamed["finish_reason"] == "length" and streamed["content"] == "", streamed
    assert streamed["calls"] == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]


def test_the_cut_reaches_into_the_arguments(server, whole_arguments):
    """At 24 tokens the bundled model has written part of the arguments: they are returned, not dropped."""
    call = _chat(server, NAMED, 24)["message"]["tool_calls"][0]["function"]
    assert call["arguments"] and len(call["arguments"]) < len(whole_arguments), (call, whole_arguments)


def test_a_required_call_cut_before_its_name_is_known_among_two_tools_leaves_no_markup(server):
    choice = _chat(server, "required", 3, tools=TWO_TOOLS)  # which of the two is not known yet
    assert choice["finish_reason"] == "length" and not choice["message"]["content"], choice
    assert not choice["message"].get("tool_calls")
    streamed = _chat(server, "required", 3, stream=True, tools=TWO_TOOLS)
    assert streamed["content"] == "" and streamed["finish_reason"] == "length"


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_anthropic_a_cut_off_forced_call_is_a_tool_use_block(server, tool_choice):
    body = {"model": MODEL, "messages": ASK, "tools": ANTHROPIC_TOOLS, "tool_choice": tool_choice, "max_tokens": 4}
    r = server.post("/v1/messages", json=body, **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["stop_reason"] == "max_tokens"
    assert [b["type"] for b in answer["content"]] == ["tool_use"] and answer["content"][0]["name"] == "get_weather"
