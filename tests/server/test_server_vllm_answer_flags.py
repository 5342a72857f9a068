"""vLLM's serve flags that shape the answers: ``--max-logprobs`` (the limit on logprobs / top_logprobs, a 400
past it), ``--return-tokens-as-token-ids`` (and the per-request ``return_tokens_as_token_ids``: logprobs tokens
as "token_id:N") and ``--response-role`` (the role of chat answers after a generation prompt; else the last
message's role). On the default server and on one started with the flags."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from .live_server import start_server, stop_server

GREEDY = {"temperature": 0, "max_tokens": 4}
MSGS = [{"role": "user", "content": "Name a color."}]
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    live = start_server(tmp_path_factory.mktemp("flagged"), "--max-logprobs", "25", "--return-tokens-as-token-ids",
                        "--response-role", "bot", "--trust-request-chat-template")
    yield live
    stop_server(live)


def _ok(server, path: str, body: dict) -> dict:
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(server, path: str, body: dict) -> list[dict]:
    r = server.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _refused(server, path: str, body: dict, param: str) -> str:
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    return error["message"]


def _ids(server, tokens: list[str]) -> list[int]:
    ids = [TOKEN_ID.match(t) for t in tokens]
    assert all(ids), tokens
    return [int(m.group(1)) for m in ids]


def _text_of(server, ids: list[int]) -> str:
    return _ok(server, "/detokenize", {"tokens": ids})["prompt"]


# ----------------------------------------------------------------- --max-logprobs
def test_the_default_limit_is_20_on_every_openai_route(server):
    assert "at most 20" in _refused(server, "/v1/chat/completions",
                                    {"messages": MSGS, **GREEDY, "logprobs": True, "top_logprobs": 21},
                                    "top_logprobs")
    _refused(server, "/v1/completions", {"prompt": "Hi", **GREEDY, "logprobs": 21}, "logprobs")
    _refused(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 21}, "top_logprobs")


def test_max_logprobs_raises_the_limit(flagged):
    body = {"messages": MSGS, **GREEDY, "logprobs": True, "top_logprobs": 25}
    content = _ok(flagged, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 25 for entry in content)
    assert "at most 25 (the server's --max-logprobs), got 26" in _refused(
        flagged, "/v1/chat/completions", {**body, "top_logprobs": 26}, "top_logprobs")
    # echo scores the prompt with the same number: the limit covers it too
    choice = _ok(flagged, "/v1/completions", {"prompt": "Hi there", **GREEDY, "logprobs": 25, "echo": True})
    lp = choice["choices"][0]["logprobs"]
    # the 25 most likely, and the chosen token besides them where it is not among those (OpenAI's legacy API)
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
        assert token in top and len(top) in (25, 26)
    _refused(flagged, "/v1/completions", {"prompt": "Hi", **GREEDY, "logprobs": 26}, "logprobs")
    _refused(flagged, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 26}, "top_logprobs")


# ----------------------------------------------------------------- token ids in logprobs
@pytest.mark.parametrize("stream", [False, True])
def test_chat_request_field_gives_token_ids_with_vllms_bytes(server, stream):
    body = {"messages": MSGS, **GREEDY, "logprobs": True, "top_logprobs": 2}
    if stream:
        plain = [e for c in _events(server, "/v1/chat/completions", body) for ch in c["choices"]
                 for e in (ch["logprobs"] or {}).get("content", [])]
        as_ids = [e for c in _events(server, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True})
                  for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])]
    else:
        plain = _ok(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
        as_ids = _ok(server, "/v1/chat/completions",
                     {**body, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]["content"]
    ids = _ids(server, [e["token"] for e in as_ids])
    assert [_text_of(server, [i]) for i in ids] == [e["token"] for e in plain]
    # as vLLM: the sampled token's bytes are its text's; a top entry's are those of its "token_id:N"
    assert [e["bytes"] for e in as_ids] == [e["bytes"] for e in plain]
    for entry in as_ids:
        assert all(TOKEN_ID.match(t["token"]) and t["bytes"] == list(t["token"].encode())
                   for t in entry["top_logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_completions_request_field_gives_token_ids(server, stream):
    body = {"prompt": "The sky is", **GREEDY, "logprobs": 2}
    flagged_body = {**body, "return_tokens_as_token_ids": True}
    if stream:
        plain_chunks = [c["choices"][0] for c in _events(server, "/v1/completions", body) if c["choices"]]
        chunks = [c["choices"][0] for c in _events(server, "/v1/completions", flagged_body) if c["choices"]]
        tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        plain_offsets = [o for c in plain_chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        text = "".join(c["text"] for c in chunks)
    else:
        plain_offsets = _ok(server, "/v1/completions", body)["choices"][0]["logprobs"]["text_offset"]
        choice = _ok(server, "/v1/completions", flagged_body)["choices"][0]
        tokens, offsets, text = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"], choice["text"]
    assert _text_of(server, _ids(server, tokens)) == text
    assert offsets == plain_offsets  # offsets still index the text, not the "token_id:N" strings


def test_echoed_prompt_tokens_are_token_ids_too(server):
    body = {"prompt": "Hello there", **GREEDY, "logprobs": 1, "echo": True, "return_tokens_as_token_ids": True}
    logprobs = _ok(server, "/v1/completions", body)["choices"][0]["logprobs"]
    prompt_ids = _ok(server, "/tokenize", {"prompt": "Hello there"})["tokens"]
    assert _ids(server, logprobs["tokens"])[:len(prompt_ids)] == prompt_ids
    assert all(TOKEN_ID.match(t) for top in logprobs["top_logprobs"][1:] for t in top)


def test_the_flag_makes_token_ids_the_default_and_a_request_can_turn_it_off(flagged):
    body = {"messages": MSGS, **GREEDY, "logprobs": True}
    content = _ok(flagged, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    _ids(flagged, [e["token"] for e in content])
    off = _ok(flagged, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": False})
    assert not any(TOKEN_ID.match(e["token"]) for e in off["choices"][0]["logprobs"]["content"])
    choice = _ok(flagged, "/v1/completions", {"prompt": "The sky is", **GREEDY, "logprobs": 0})["choices"][0]
    assert _text_of(flagged, _ids(flagged, choice["logprobs"]["tokens"])) == choice["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_flag_gives_token_ids_in_responses_logprobs_too(flagged, server, stream):
    """As vLLM's Responses API: the server flag turns output_text.logprobs into "token_id:N", streamed and not;
    a request's return_tokens_as_token_ids is not a Responses field there, nor here."""
    body = {"input": "Name a color.", "max_output_tokens": 4, "temperature": 0, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}

    def logprobs(live, extra: dict) -> tuple[list[dict], str]:
        if not stream:
            part = _ok(live, "/v1/responses", {**body, **extra})["output"][0]["content"][0]
            return part["logprobs"], part["text"]
        r = live.post("/v1/responses", json={**body, **extra, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        done = next(e for e in events if e["type"] == "response.output_text.done")  # the deltas' logprobs, whole
        return done["logprobs"], done["text"]

    entries, text = logprobs(flagged, {})
    assert _text_of(flagged, _ids(flagged, [e["token"] for e in entries])) == text
    assert all(TOKEN_ID.match(t["token"]) for e in entries for t in e["top_logprobs"])
    plain, _ = logprobs(server, {"return_tokens_as_token_ids": True})
    assert plain and not any(TOKEN_ID.match(e["token"]) for e in plain)


# ----------------------------------------------------------------- --response-role
def test_the_default_role_is_assistant(server):
    assert _ok(server, "/v1/chat/completions", {"messages": MSGS, **GREEDY})["choices"][0]["message"]["role"] == (
        "assistant")


def test_response_role_names_chat_answers(flagged):
    assert _ok(flagged, "/v1/chat/completions", {"messages": MSGS, **GREEDY})["choices"][0]["message"]["role"] == "bot"
    events = _events(flagged, "/v1/chat/completions", {"messages": MSGS, **GREEDY, "n": 2})
    first = {c["choices"][0]["index"]: c["choices"][0]["delta"] for c in reversed(events) if c["choices"]}
    assert first == {0: {"role": "bot", "content": ""}, 1: {"role": "bot", "content": ""}}
    assert all("role" not in c["choices"][0]["delta"] for c in events[2:] if c["choices"])


def test_without_a_generation_prompt_the_role_is_the_last_messages(flagged):
    body = {"messages": MSGS, **GREEDY, "add_generation_prompt": False}
    assert _ok(flagged, "/v1/chat/completions", body)["choices"][0]["message"]["role"] == "user"
    assert _events(flagged, "/v1/chat/completions", body)[0]["choices"][0]["delta"]["role"] == "user"
    prefill = {"messages": [*MSGS, {"role": "assistant", "content": "Blue"}], **GREEDY, "continue_final_message": True}
    assert _ok(flagged, "/v1/chat/completions", prefill)["choices"][0]["message"]["role"] == "assistant"


def test_chat_echo_puts_the_continued_message_before_the_answer(server):
    """vLLM's chat ``echo``: when the answer's role is the last message's (here a continued assistant prefill),
    the answer starts with that message's text, in the body and in a chunk of its own after the role chunk; a
    request whose answer opens a new turn echoes nothing."""
    prefill = {"messages": [*MSGS, {"role": "assistant", "content": "My favourite colour is"}], **GREEDY,
               "continue_final_message": True}
    plain = _ok(server, "/v1/chat/completions", prefill)["choices"][0]["message"]["content"]
    echoed = _ok(server, "/v1/chat/completions", {**prefill, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "My favourite colour is" + plain
    events = _events(server, "/v1/chat/completions", {**prefill, "echo": True, "n": 2})
    deltas = [c["choices"][0] for c in events if c["choices"]]
    assert [d["delta"] for d in deltas[2:4]] == [{"content": "My favourite colour is"}] * 2
    assert [d["index"] for d in deltas[2:4]] == [0, 1]
    streamed = "".join(d["delta"].get("content") or "" for d in deltas if d["index"] == 0)
    assert streamed == echoed
    new_turn = _ok(server, "/v1/chat/completions", {"messages": MSGS, **GREEDY, "echo": True})
    assert new_turn["choices"][0]["message"]["content"] == _ok(
        server, "/v1/chat/completions", {"messages": MSGS, **GREEDY})["choices"][0]["message"]["content"]
    r = server.post("/v1/chat/completions", json={"messages": MSGS, **GREEDY, "echo": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_anthropic_and_responses_answers_keep_their_roles(flagged):
    model = httpx.get(f"{flagged.v1}/models", headers=flagged.headers(), timeout=30).json()["data"][0]["id"]
    message = _ok(flagged, "/v1/messages", {"model": model, "max_tokens": 4, "messages": MSGS})
    assert message["role"] == "assistant"
    response = _ok(flagged, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "temperature": 0})
    assert all(item["role"] == "assistant" for item in response["output"] if item["type"] == "message")


BRACKETS = "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ suffix | default('') }}"


def test_tokenize_renders_messages_with_the_request_chat_template(flagged):
    """The message text is tokenized on its own (the protocol layer keeps it literal), so the ids are compared
    through their text."""
    body = {"messages": MSGS, "chat_template": BRACKETS, "chat_template_kwargs": {"suffix": "!"}}
    tokens = _ok(flagged, "/tokenize", body)["tokens"]
    assert _ok(flagged, "/detokenize", {"tokens": tokens})["prompt"] == "[Name a color.]!"
    default = _ok(flagged, "/tokenize", {"messages": MSGS})["tokens"]
    assert "[Name a color.]" not in _ok(flagged, "/detokenize", {"tokens": default})["prompt"]  # the model's own


def test_tokenize_refuses_what_chat_completions_refuses(server, flagged):
    _refused(server, "/tokenize", {"messages": MSGS, "chat_template": BRACKETS}, "chat_template")  # no flag
    _refused(flagged, "/tokenize", {"prompt": "hi", "chat_template": BRACKETS}, "chat_template")
    _refused(flagged, "/tokenize", {"prompt": "hi", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs")
    _refused(flagged, "/tokenize", {"messages": MSGS, "continue_final_message": True, "add_generation_prompt": True},
             "continue_final_message")

