"""``x-dsinfer-first-token`` (the P/D router's decode step) and ``return_token_ids`` on the live server: the
answer starts with the preset token and goes on as a single request's, and a header it cannot take is a 400."""

from __future__ import annotations

import httpx
import pytest

HEADER = "x-dsinfer-first-token"


def _post(server, path: str, body: dict, first: str | None = None) -> httpx.Response:
    headers = server.headers() | ({HEADER: first} if first is not None else {})
    return httpx.post(f"{server.v1}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_preset_first_token_gives_the_single_requests_answer(server, model, path):
    body = {"model": model, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    body |= {"prompt": "The capital of France is"} if path == "/completions" else {
        "messages": [{"role": "user", "content": "Name a colour."}]}
    whole = _post(server, path, body).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] > 1
    started = _post(server, path, body, str(ids[0])).json()
    assert started["choices"][0]["token_ids"] == ids
    assert started["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    text = "text" if path == "/completions" else "message"
    assert started["choices"][0][text] == whole["choices"][0][text]


@pytest.mark.parametrize(("first", "extra", "message"), [
    ("x1", {}, "must be a token id"),
    ("3", {"n": 2}, "needs n=1"),
    ("3", {"logprobs": 1}, "no logprobs"),
])
def test_a_first_token_that_cannot_stand_for_the_first_sample_is_a_400(server, model, first, extra, message):
    r = _post(server, "/completions", {"model": model, "prompt": "Hi", "max_tokens": 3, **extra}, first)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
