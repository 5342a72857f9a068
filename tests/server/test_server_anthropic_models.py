"""Anthropic clients on the routes both APIs share, and request ids: the official anthropic SDK's
``models.list()`` / ``models.retrieve()`` get Anthropic's shapes from /v1/models (the openai SDK keeps OpenAI's),
Anthropic responses (streams and errors included) carry ``request-id: req_...``, and every response carries
vLLM's ``x-request-id`` (the client's own echoed)."""

from __future__ import annotations

from datetime import datetime

import anthropic
import httpx
import openai
import pytest

from .live_server import API_KEY, MAX_MODEL_LEN, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name a color."}]
ANTHROPIC_HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}


def _is_anthropic_id(value: str | None) -> bool:
    return isinstance(value, str) and value.startswith("req_") and len(value) > 8


def test_anthropic_sdk_lists_and_retrieves_models(claude, server):
    page = claude.models.list()
    assert [m.id for m in page.data] == [MODEL]
    info = page.data[0]
    assert info.type == "model" and info.display_name == MODEL and isinstance(info.created_at, datetime)
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL, MODEL)
    assert claude.models.retrieve(MODEL).model_dump() == info.model_dump()
    assert info.lifecycle == "active" and info.max_input_tokens == info.max_tokens == MAX_MODEL_LEN - 1
    # the wire shape, exactly: no OpenAI fields
    body = httpx.get(f"{server.v1}/models", headers=ANTHROPIC_HEADERS, timeout=30).json()
    created = body["data"][0]["created_at"]
    assert body == {"data": [{"type": "model", "id": MODEL, "display_name": MODEL, "created_at": created,
                              "lifecycle": "active", "max_input_tokens": MAX_MODEL_LEN - 1,
                              "max_tokens": MAX_MODEL_LEN - 1}],
                    "has_more": False, "first_id": MODEL, "last_id": MODEL}
    assert created.endswith("Z") and datetime.fromisoformat(created) == info.created_at


def test_anthropic_sdk_unknown_model_is_a_404_in_anthropics_envelope(claude):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.models.retrieve("claude-sonnet-4-5")
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in err.value.body["error"]["message"]
    assert _is_anthropic_id(err.value.request_id)


def test_anthropic_limit_is_checked(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.models.list(limit=0)
    assert err.value.body["error"]["type"] == "invalid_request_error" and "limit" in err.value.body["error"]["message"]


def test_openai_clients_keep_openais_shapes(client, server):
    models = client.models.list()
    assert models.object == "list" and models.data[0].object == "model" and models.data[0].id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("claude-sonnet-4-5")
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["code"] == "model_not_found"
    # anthropic-version beside an OpenAI-only header is an OpenAI client
    r = httpx.get(f"{server.v1}/models", timeout=30,
                  headers={**ANTHROPIC_HEADERS, "OpenAI-Organization": "org-1"})
    assert r.json()["object"] == "list" and "request-id" not in r.headers
    r = httpx.get(f"{server.v1}/models/nope", timeout=30, headers={**ANTHROPIC_HEADERS, "OpenAI-Project": "p"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_messages_carry_a_request_id(claude):
    raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    message = raw.parse()
    assert _is_anthropic_id(message._request_id) and message._request_id == raw.headers["request-id"]
    again = claude.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert _is_anthropic_id(again._request_id) and again._request_id != message._request_id
    with claude.messages.stream(model=MODEL, max_tokens=3, messages=MESSAGES) as stream:
        final = stream.get_final_message()
        assert _is_anthropic_id(stream.response.headers.get("request-id"))
    assert final.content
    tokens = claude.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert _is_anthropic_id(tokens._request_id)


def test_anthropic_errors_carry_a_request_id(claude, server):
    with pytest.raises(anthropic.BadRequestError) as err:  # the route's own 400
        claude.messages.create(model=MODEL, max_tokens=-1, messages=MESSAGES)
    assert _is_anthropic_id(err.value.request_id)
    locked_out = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as err:  # the guard's 401, before any route
        locked_out.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert _is_anthropic_id(err.value.request_id)


def test_openai_routes_carry_x_request_id_echoing_the_clients(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert len(raw.headers["x-request-id"]) >= 16 and "request-id" not in raw.headers
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                           extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42"
    with client.completions.with_streaming_response.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                                          extra_headers={"X-Request-Id": "trace-43"}) as stream:
        assert stream.headers["x-request-id"] == "trace-43"
        assert list(stream.iter_lines())
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1,
                                       extra_headers={"X-Request-Id": "trace-44"})
    assert err.value.response.headers["x-request-id"] == "trace-44"


@pytest.fixture(scope="module")
def three_names(tmp_path_factory):
    from dsinfer.models.loader.resolve import resolve_model_dir

    model_dir, _ = resolve_model_dir(None, "auto")  # the bundled model, as the session server's
    live = start_server(tmp_path_factory.mktemp("three_names"), "--model", str(model_dir),
                        "--served-model-name", "m-a", "m-b", "m-c")
    yield live
    stop_server(live)


def test_anthropic_pagination(three_names):
    claude = anthropic.Anthropic(base_url=three_names.url, api_key=API_KEY, max_retries=0, timeout=60)
    page = claude.models.list(limit=2)
    assert ([m.id for m in page.data], page.has_more, page.first_id, page.last_id) == (["m-a", "m-b"], True,
                                                                                        "m-a", "m-b")
    assert [m.id for m in page] == ["m-a", "m-b", "m-c"]  # the SDK's auto-pagination: after_id=last_id
    last = claude.models.list(limit=2, after_id="m-b")
    assert ([m.id for m in last.data], last.has_more) == (["m-c"], False)
    before = claude.models.list(limit=1, before_id="m-c")
    assert ([m.id for m in before.data], before.has_more) == (["m-b"], True)
    assert claude.models.list(after_id="m-x").data == []
    assert claude.models.retrieve("m-b").id == "m-b"
    with pytest.raises(anthropic.BadRequestError):
        claude.models.list(after_id="m-a", before_id="m-c")
