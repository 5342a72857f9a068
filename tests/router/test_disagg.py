"""What the P/D router's prefill step asks for and which decode steps start from its first token."""

from __future__ import annotations

import json

import pytest

from dsinfer.router.disagg import carries_first_token, first_token_of, prefill_body

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


def test_the_prefill_step_asks_for_its_token_id_where_the_decode_step_starts_from_it():
    body = prefill_body("/v1/chat/completions", CHAT)
    assert body == {"messages": CHAT["messages"], "max_tokens": 1, "return_token_ids": True}
    assert "return_token_ids" not in prefill_body("/v1/messages", {**CHAT, "model": "m"})
    assert prefill_body("/v1/responses", {"input": "hi"}) == {"input": "hi", "max_output_tokens": 1}


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/messages", {}), ("/v1/responses", {}), ("/v1/chat/completions", {"n": 2}),
    ("/v1/chat/completions", {"logprobs": True}), ("/v1/completions", {"logprobs": 0}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"tools": [{"type": "function"}], "tool_choice": "required"}),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/completions", {"prompt": ["a", "b"]}), ("/v1/completions", {"prompt": [[1, 2]]}),
    ("/v1/completions", {"echo": True}), ("/v1/completions", {"structured_outputs": {"regex": "a"}}),
])
def test_a_request_whose_first_token_must_be_its_own_sample_is_not_started_from_the_prefills(path, extra):
    assert not carries_first_token(path, {**CHAT, **extra})


@pytest.mark.parametrize("extra", [{}, {"logprobs": False}, {"response_format": {"type": "text"}},
                                   {"tool_choice": "auto", "tools": [{"type": "function"}]}, {"n": 1}])
def test_a_plain_chat_or_completion_is_started_from_the_prefills_first_token(extra):
    assert carries_first_token("/v1/chat/completions", {**CHAT, **extra})
    assert carries_first_token("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, **extra})


def test_the_first_token_is_read_from_the_prefill_answer():
    assert first_token_of(json.dumps({"choices": [{"token_ids": [42]}]}).encode()) == 42
    for answer in (b"not json", b"{}", json.dumps({"choices": [{"text": "x"}]}).encode(),
                   json.dumps({"choices": [{"token_ids": []}]}).encode()):
        assert first_token_of(answer) is None
