"""/v1/responses refuses an input item without a field the openai SDK's types require, as OpenAI's API: a 400 in
OpenAI's envelope naming the field's path (it was answered 200, the missing content read as ""), and still answers
the items those types allow."""

from __future__ import annotations

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("items, param, says", [
    ([{"type": "message", "role": "user"}], "input.0.content", "Field required when type is 'message'"),
    ([{"role": "user", "content": "Hi"}, {"type": "message", "content": "Hi"}], "input.1.role", "Field required"),
    ([{"type": "function_call", "name": "get_weather", "arguments": "{}"}], "input.0.call_id", "Field required"),
    ([{"role": "user", "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}],
     "input.0.content.0.type", "'output_text' is not allowed in a user message"),
])
def test_an_item_missing_what_the_sdk_requires_is_a_400_naming_it(server, items, param, says):
    r = server.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
    assert says in error["message"]


def test_sdk_typed_items_are_answered(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
             {"role": "user", "content": "Thanks."}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=1)
    assert r.status == "incomplete" and r.output


def test_the_sdk_reads_the_400_for_a_missing_content(client):
    """Through the SDK too: its 400 is a BadRequestError whose param names the field."""
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"type": "message", "role": "user"}], max_output_tokens=1)
    assert err.value.param == "input.0.content" and err.value.type == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("previous_response_id", "resp_1"), ("conversation", "conv_1"),
                                          ("conversation", {"id": "conv_1"}), ("prompt", {"id": "pmpt_1"}),
                                          ("background", True)])
def test_stored_or_stateful_features_are_a_400_naming_them(server, field, value):
    """This server keeps no responses, conversations or prompt templates and answers in the request: a request
    that relies on them is refused, not answered without them."""
    r = server.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"]


def test_truncation_takes_the_apis_values(server):
    assert server.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                              "truncation": "auto"}).status_code == 200
    r = server.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "truncation": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation", r.text


def test_include_takes_the_apis_values(server):
    """``include``'s values are the SDK's ``ResponseIncludable``: those naming tools this server lacks add nothing;
    any other is a 400 naming the field."""
    r = server.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                           "include": ["reasoning.encrypted_content", "file_search_call.results"]})
    assert r.status_code == 200, r.text
    r = server.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "include": ["output.everything"]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("include"), r.text
