"""Anthropic's error bodies carry the request id, as Anthropic's API sends them:
``{"type": "error", "error": {...}, "request_id": "req_..."}`` with the ``request-id`` header's value, for every
status (the handlers', the guard's) and in a stream's ``error`` event; OpenAI's bodies stay as they were.

The app is dsinfer's own (``build_app``) on a scripted engine, in process: overloaded, dead and draining engines
are states a live server only reaches by accident."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic
import httpx
import openai
import openai.types.responses as response_types
import pytest

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.entrypoints.async_engine import EngineDeadError, EngineOverloadedError
from dsinfer.server.app import build_app
from dsinfer.server.settings import ServerSettings
from dsinfer.tokenizer import Tokenizer

from ..protocol.tiny_tokenizer import write_tiny_tokenizer

KEY = "sk-ids"
ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
OPENAI = {"Authorization": f"Bearer {KEY}"}
ASK = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}


class _Engine:
    """``mode``: "ok" finishes after one output, "overloaded" refuses at once (429; Anthropic's routes 529), "dies"
    fails after its first
    output (the stream has started: an in-stream error event), "bug" raises what no handler takes (a 500)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=256, vocab_size=None, sampling_defaults={},
                                            max_tokens_limit=None, logprobs_limit=20)
        self.mode, self.draining, self.dead = "ok", False, False

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    async def generate(self, prompt, params, request_id, priority=0):
        if self.mode == "overloaded":
            raise EngineOverloadedError("3 requests are already waiting (limit 3)")
        if self.mode == "bug":
            raise KeyError("an error no handler knows")
        finished = self.mode == "ok"
        yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None,
                            [CompletionOutput(0, "Hi", [5], finish_reason="stop" if finished else None)], finished)
        if self.mode == "dies":
            raise EngineDeadError("the engine loop crashed")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok")))


@pytest.fixture
def engine(tokenizer) -> _Engine:
    return _Engine(tokenizer)


def _call(engine: _Engine, method: str, path: str, headers: dict, **kwargs) -> httpx.Response:
    app = build_app(engine, ServerSettings(api_keys=(KEY,), max_body_bytes=4096))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsinfer") as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    """The body, checked to be Anthropic's envelope with the header's request id."""
    body = r.json()
    assert r.status_code == status and r.headers["request-id"].startswith("req_"), (r.status_code, body)
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]},
                    "request_id": r.headers["request-id"]}
    if kind != "request_too_large":  # Anthropic's 413 type, which the SDK's ErrorObject union does not list
        anthropic.types.ErrorResponse.model_validate(body, strict=True)
    return body


@pytest.mark.parametrize("case, status, kind", [
    ("bad field", 400, "invalid_request_error"),
    ("bad JSON", 400, "invalid_request_error"),
    ("too deep", 400, "invalid_request_error"),
    ("no key", 401, "authentication_error"),
    ("no route", 404, "not_found_error"),
    ("too large", 413, "request_too_large"),
    ("overloaded", 529, "overloaded_error"),  # a full queue: Anthropic's status (OpenAI's routes answer 429)
    ("draining", 503, "overloaded_error"),
])
def test_anthropic_error_bodies_carry_the_request_id_header(engine, case, status, kind):
    headers, kwargs = dict(ANTHROPIC), {"json": ASK}
    path = "/v1/messages/nope" if case == "no route" else "/v1/messages"
    if case == "bad field":
        kwargs = {"json": {**ASK, "max_tokens": 0}}
    elif case == "bad JSON":
        kwargs = {"content": b'{"model": ', "headers": {"content-type": "application/json"}}
    elif case == "too deep":
        kwargs = {"content": b"[" * 100 + b"]" * 100}
    elif case == "no key":
        headers.pop("x-api-key")
    elif case == "too large":
        kwargs = {"json": {**ASK, "system": "x" * 5000}}
    engine.mode = "overloaded" if case == "overloaded" else "ok"
    engine.draining = case == "draining"
    body = _anthropic_error(_call(engine, "POST", path, {**headers, **kwargs.pop("headers", {})}, **kwargs),
                            status, kind)
    assert body["error"]["message"]


def test_anthropic_model_routes_carry_it_for_an_anthropic_client(engine):
    """/v1/models answers an Anthropic client in Anthropic's envelope, the guard's 401 included (it was
    OpenAI's, with an Anthropic request-id header)."""
    _anthropic_error(_call(engine, "GET", "/v1/models", {"anthropic-version": "2023-06-01"}),
                     401, "authentication_error")
    body = _anthropic_error(_call(engine, "GET", "/v1/models/claude-nope", ANTHROPIC), 404, "not_found_error")
    assert "claude-nope" in body["error"]["message"]


def test_anthropic_in_stream_error_event_carries_the_request_id(engine):
    engine.mode = "dies"
    r = _call(engine, "POST", "/v1/messages", ANTHROPIC, json={**ASK, "stream": True})
    assert r.status_code == 200
    events = [chunk.split("\n", 1) for chunk in r.text.strip().split("\n\n")]
    name, data = events[-1]
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the engine loop crashed"},
        "request_id": r.headers["request-id"]}


@pytest.mark.parametrize("case", ["bad field", "no key", "overloaded", "draining"])
def test_openai_error_bodies_are_unchanged(engine, case):
    headers = {} if case == "no key" else OPENAI
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 0 if case == "bad field" else 4}
    engine.mode = "overloaded" if case == "overloaded" else "ok"
    engine.draining = case == "draining"
    r = _call(engine, "POST", "/v1/chat/completions", headers, json=body)
    assert r.status_code == {"bad field": 400, "no key": 401, "overloaded": 429, "draining": 503}[case]
    assert "request-id" not in r.headers and r.headers["x-request-id"]
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}


def _sdk_http_client(sdk, app):
    """An in-process client for ``app`` of the HTTP package the SDK is built on (httpx, or httpx2 in newer SDKs,
    which refuse the other's objects)."""
    http = getattr(sdk._base_client, "httpx2", None) or sdk._base_client.httpx
    return http.AsyncClient(transport=http.ASGITransport(app=app), base_url="http://dsinfer")


def test_a_full_queue_is_the_anthropic_sdks_overloaded_error_and_openai_s_rate_limit(engine):
    """Each SDK, without retries, raises its own exception for a full queue: ``anthropic.OverloadedError``
    (529), ``openai.RateLimitError`` (429); both answers say when to retry."""
    import openai

    engine.mode = "overloaded"
    app = build_app(engine, ServerSettings(api_keys=(KEY,)))

    async def go() -> None:
        async with _sdk_http_client(anthropic, app) as http:
            claude = anthropic.AsyncAnthropic(api_key=KEY, base_url="http://dsinfer", http_client=http,
                                              max_retries=0)
            with pytest.raises(anthropic.OverloadedError) as caught:
                await claude.messages.create(**ASK)
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["error"]["type"] == "overloaded_error"
        async with _sdk_http_client(openai, app) as http:
            gpt = openai.AsyncOpenAI(api_key=KEY, base_url="http://dsinfer/v1", http_client=http, max_retries=0)
            with pytest.raises(openai.RateLimitError) as caught:
                await gpt.chat.completions.create(model="tiny", messages=ASK["messages"], max_tokens=4)
        assert caught.value.response.headers["retry-after"] == "1"

    asyncio.run(go())


def test_openai_in_stream_error_is_unchanged(engine):
    engine.mode = "dies"
    r = _call(engine, "POST", "/v1/chat/completions", OPENAI,
              json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True})
    errors = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {\"error\"")]
    assert errors == [{"error": {"message": "the engine loop crashed", "type": "service_unavailable_error",
                                 "param": None, "code": None}}]


def test_an_unhandled_error_is_a_500_with_the_ids_and_is_counted(engine):
    """An exception no handler takes answers 500 in the route's envelope from inside the middlewares: with
    ``x-request-id`` (and Anthropic's ``request-id``, also in the body), and counted in /metrics. Starlette's
    catch-all answered outside them: no ids, not counted."""
    engine.mode = "bug"
    app = build_app(engine, ServerSettings(api_keys=(KEY,)))
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsinfer") as client:
            openai = await client.post("/v1/chat/completions", headers=OPENAI, json=chat)
            claude = await client.post("/v1/messages", headers=ANTHROPIC, json=ASK)
            return openai, claude

    openai, claude = asyncio.run(go())
    assert openai.status_code == 500 and openai.headers["x-request-id"]
    assert openai.json()["error"]["message"] == "internal server error"
    assert "KeyError" not in openai.text and "no handler" not in openai.text  # nothing of the bug leaks
    body = _anthropic_error(claude, 500, "api_error")
    assert body["error"]["message"] == "internal server error"
    counted = {(sample.labels["path"], sample.labels["status"]): sample.value
               for metric in app.state.ctx.metrics.requests.collect() for sample in metric.samples
               if sample.name.endswith("_total")}
    assert counted[("/v1/chat/completions", "500")] == 1 and counted[("/v1/messages", "500")] == 1



def test_responses_in_stream_error_event_is_typed_error(engine):
    """The openai SDK's ``ResponseErrorEvent``: ``type`` "error" with the error's message, code and param (the
    error's own type must not replace it, or the SDK reads another event class and never sees the error)."""
    engine.mode = "dies"
    r = _call(engine, "POST", "/v1/responses", OPENAI, json={"input": "Hello", "max_output_tokens": 4,
                                                             "stream": True})
    assert r.status_code == 200
    name, data = r.text.strip().split("\n\n")[-1].split("\n", 1)
    event = json.loads(data.removeprefix("data: "))
    assert name == "event: error" and event["type"] == "error" and event["message"] == "the engine loop crashed"
    assert set(event) == {"type", "sequence_number", "message", "code", "param"}
    parsed = openai._models.construct_type(type_=response_types.ResponseStreamEvent, value=event)
    assert isinstance(parsed, response_types.ResponseErrorEvent)
