"""vLLM's ``prompt_logprobs`` request field on chat and completions: the prompt's logprobs in the answer
(completions: on each choice; chat: beside the choices), one entry per prompt token, the first null; a 400 with
``stream`` and past ``--max-logprobs``, as vLLM."""

from __future__ import annotations

import math

import pytest

PROMPT = "The capital of France is"
MSGS = [{"role": "user", "content": "Name a color."}]


def _ok(server, path: str, body: dict) -> dict:
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _check_positions(entries: list, prompt_ids: list[int], k: int) -> None:
    assert len(entries) == len(prompt_ids)
    assert entries[0] is None
    for tid, position in zip(prompt_ids[1:], entries[1:]):
        assert str(tid) in position  # the prompt's own token, besides the k most likely
        assert len(position) <= k + 1
        for entry in position.values():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0 and entry["rank"] >= 1


def test_completions_prompt_logprobs_score_the_prompt_like_echo(server):
    ids = _ok(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = _ok(server, "/v1/completions", {**body, "prompt_logprobs": 2, "n": 2})
    assert len(r["choices"]) == 2
    for choice in r["choices"]:
        _check_positions(choice["prompt_logprobs"], ids, 2)
    echoed = _ok(server, "/v1/completions", {**body, "echo": True, "logprobs": 2})["choices"][0]["logprobs"]
    scores = [p[str(t)]["logprob"] for t, p in zip(ids[1:], r["choices"][0]["prompt_logprobs"][1:])]
    assert scores == pytest.approx(echoed["token_logprobs"][1:len(ids)], abs=1e-4)
    # not asked: no such key
    assert "prompt_logprobs" not in _ok(server, "/v1/completions", body)["choices"][0]


def test_chat_prompt_logprobs_cover_the_rendered_conversation(server):
    ids = _ok(server, "/tokenize", {"messages": MSGS})["tokens"]
    r = _ok(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 0})
    assert r["usage"]["prompt_tokens"] == len(ids)
    _check_positions(r["prompt_logprobs"], ids, 0)
    assert "prompt_logprobs" not in _ok(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MSGS}),
])
@pytest.mark.parametrize("extra, match", [
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": 21}, "at most 20"),
    ({"prompt_logprobs": -1}, "at most 20"),  # -1 is the whole vocabulary
    ({"prompt_logprobs": -2}, "greater than or equal to -1"),
    ({"prompt_logprobs": "2"}, "valid integer"),
])
def test_bad_prompt_logprobs_are_400(server, path, body, extra, match):
    r = server.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" and match in error["message"]
    assert server.alive()
