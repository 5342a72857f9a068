"""tool_choice as OpenAI / vLLM / Anthropic answer it: a named function finishes with "stop"; "none" keeps the tools
in the prompt (the answer is not parsed for calls) unless the server runs with --exclude-tools-when-tool-choice-none.
"""

from __future__ import annotations

import json

import pytest

from .live_server import start_server, stop_server
from .weather_tools import ANTHROPIC_TOOLS, ASK, CHAT_TOOLS, MODEL, RESPONSES_TOOLS

CHAT = "/v1/chat/completions"
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# the Hermes call markup the server parses: forced as the answer's text, it would be a call if parsed
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def excluding_server(tmp_path_factory):
    live = start_server(tmp_path_factory.mktemp("exclude"), "--exclude-tools-when-tool-choice-none")
    yield live
    stop_server(live)


def _chat(server, **body):
    r = server.post(CHAT, json={"messages": ASK, "max_tokens": 48, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream_chunks(server, **body) -> list[dict]:
    r = server.post(CHAT, json={"messages": ASK, "max_tokens": 48, "temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("tool_choice, finish", [(NAMED, "stop"), ("required", "tool_calls")])
def test_forced_call_finish_reason_streamed_and_not(server, tool_choice, finish):
    """A named function is answered "stop" (the call is still in the message / deltas), as OpenAI and vLLM;
    "required" (the model chose which tool) stays "tool_calls"."""
    choice = _chat(server, tools=CHAT_TOOLS, tool_choice=tool_choice)["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == finish
    chunks = _stream_chunks(server, tools=CHAT_TOOLS, tool_choice=tool_choice)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert any(d["delta"].get("tool_calls") for d in deltas)
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == [finish]


def _prompt_tokens(server) -> dict[str, int]:
    """The chat, Responses and Anthropic prompt sizes without tools, with tools and "auto", and with "none"."""
    sizes = {}
    for case, extra in (("bare", {}), ("auto", {"tool_choice": "auto"}), ("none", {"tool_choice": "none"})):
        with_tools = bool(extra)
        chat = _chat(server, max_tokens=1, **({"tools": CHAT_TOOLS, **extra} if with_tools else {}))
        r = server.post("/v1/responses", json={"input": ASK[0]["content"], "max_output_tokens": 1,
                                               **({"tools": RESPONSES_TOOLS, **extra} if with_tools else {})})
        assert r.status_code == 200, r.text
        anthropic = {"model": MODEL, "messages": ASK}
        if with_tools:
            anthropic.update(tools=ANTHROPIC_TOOLS, tool_choice={"type": extra["tool_choice"]})
        counted = server.post("/v1/messages/count_tokens", json=anthropic)
        assert counted.status_code == 200, counted.text
        m = server.post("/v1/messages", json={**anthropic, "max_tokens": 1})
        assert m.status_code == 200, m.text
        usage = m.json()["usage"]
        sizes[case] = (chat["usage"]["prompt_tokens"], r.json()["usage"]["input_tokens"],
                       counted.json()["input_tokens"], usage["input_tokens"] + usage["cache_read_input_tokens"])
    return sizes


def test_tool_choice_none_keeps_the_tools_in_the_prompt(server):
    sizes = _prompt_tokens(server)
    for bare, auto, none in zip(sizes["bare"], sizes["auto"], sizes["none"], strict=True):
        assert none == auto > bare, sizes


def test_tool_choice_none_parses_no_calls(server):
    """Call markup the model writes under "none" stays text (with "auto" the same text is a call)."""
    forced = {"tools": CHAT_TOOLS, "guided_choice": [CALL_TEXT], "max_tokens": 120}  # room for any tokenization
    choice = _chat(server, tool_choice="none", **forced)["choices"][0]
    assert choice["message"]["content"] == CALL_TEXT and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert _chat(server, tool_choice="auto", **forced)["choices"][0]["finish_reason"] == "tool_calls"


def test_exclude_flag_leaves_the_tools_out_under_none(excluding_server):
    sizes = _prompt_tokens(excluding_server)
    for bare, auto, none in zip(sizes["bare"], sizes["auto"], sizes["none"], strict=True):
        assert none == bare < auto, sizes
