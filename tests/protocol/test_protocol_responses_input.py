"""The Responses API's input items: what the openai SDK's input item types (``ResponseInputItemParam``) require is
required (a 400 naming the field's path, as OpenAI's "Missing required parameter"), and everything those types
allow is accepted; each item becomes the template message it says."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dsinfer.protocol.conversation import responses_messages
from dsinfer.protocol.errors import ProtocolError, describe_validation_errors
from dsinfer.protocol.responses_schemas import ResponsesRequest

CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
# each one as the SDK's type named beside it has it, with its required fields only unless said
ALLOWED = {
    "EasyInputMessageParam, text": [{"role": "user", "content": "Hi"}],
    "EasyInputMessageParam, typed, every role": [{"type": "message", "role": r, "content": "Hi"}
                                                 for r in ("system", "developer", "user", "assistant")],
    "EasyInputMessageParam, assistant with input_text": [{"role": "assistant",
                                                          "content": [{"type": "input_text", "text": "Hi"}]}],
    "EasyInputMessageParam, empty content": [{"role": "user", "content": ""}, {"role": "user", "content": []}],
    "Message, input_text parts": [{"type": "message", "role": "developer", "status": "completed",
                                   "content": [{"type": "input_text", "text": "A"}, {"type": "input_text",
                                                                                       "text": "B"}]}],
    "ResponseOutputMessageParam": [{"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                                    "phase": "final_answer",
                                    "content": [{"type": "output_text", "text": "Sunny", "annotations": []},
                                                {"type": "refusal", "refusal": "No."}]}],
    "ResponseFunctionToolCallParam + FunctionCallOutput": [
        {**CALL, "id": "fc_1", "status": "completed"}, {"type": "function_call_output", "call_id": "c1",
                                                        "output": "Sunny"}],
    "FunctionCallOutput without call_id, text parts": [
        {"type": "function_call_output", "output": [{"type": "input_text", "text": "Sunny"}]}],
    "ResponseReasoningItemParam": [{"type": "reasoning", "id": "rs_1", "summary": [],
                                    "content": [{"type": "reasoning_text", "text": "hm"}]},
                                   {"type": "reasoning", "id": "rs_2",
                                    "summary": [{"type": "summary_text", "text": "hm"}]}],
}
REFUSED = {
    "message without content": ([{"type": "message", "role": "user"}], "input.0.content"),
    "message with null content": ([{"type": "message", "role": "user", "content": None}], "input.0.content"),
    "message without role": ([{"type": "message", "content": "Hi"}], "input.0.role"),
    "untyped message without role": ([{"role": "user", "content": "Hi"}, {"content": "Hi"}], "input.1.role"),
    "call without call_id": ([{k: v for k, v in CALL.items() if k != "call_id"}], "input.0.call_id"),
    "call without name": ([{k: v for k, v in CALL.items() if k != "name"}], "input.0.name"),
    "call without arguments": ([{k: v for k, v in CALL.items() if k != "arguments"}], "input.0.arguments"),
    "call output without output": ([CALL, {"type": "function_call_output", "call_id": "c1"}], "input.1.output"),
    "reasoning without summary": ([{"type": "reasoning", "id": "rs_1"}], "input.0.summary"),
    "reasoning without id": ([{"type": "reasoning", "summary": []}], "input.0.id"),
    "input_text without text": ([{"role": "user", "content": [{"type": "input_text"}]}], "input.0.content.0.text"),
    "refusal without refusal": ([{"role": "assistant", "content": [{"type": "refusal", "text": "No."}]}],
                                "input.0.content.0.refusal"),
    "chat's text part": ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "input.0.content.0.type"),
    "tool role": ([{"role": "tool", "content": "Sunny"}], "input.0.role"),
}
# allowed by the schema, refused by the conversion: a part type the item's role does not take
WRONG_PART = {
    "output_text in a user message": ([{"role": "user", "content": [{"type": "output_text", "text": "Hi"}]}],
                                      "input.0.content.0.type"),
    "refusal in a system message": ([{"role": "system", "content": [{"type": "input_text", "text": "A"},
                                                                    {"type": "refusal", "refusal": "No"}]}],
                                    "input.0.content.1.type"),
    "output_text in a call output": ([CALL, {"type": "function_call_output", "call_id": "c1",
                                             "output": [{"type": "output_text", "text": "Sunny"}]}],
                                     "input.1.output.0.type"),
    "reasoning_text in an assistant message": ([{"role": "assistant",
                                                 "content": [{"type": "reasoning_text", "text": "hm"}]}],
                                               "input.0.content.0.type"),
    "an image (text only)": ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}],
                             "input.0.content.0.type"),
}


def _request(items: list[dict]) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": items}))


@pytest.mark.parametrize("case", ALLOWED)
def test_every_item_the_sdk_types_allow_is_accepted(case):
    assert isinstance(responses_messages(_request(ALLOWED[case])), list)  # reasoning items alone: none


@pytest.mark.parametrize("case", REFUSED)
def test_a_missing_required_field_is_refused_naming_its_path(case):
    items, param = REFUSED[case]
    with pytest.raises(ValidationError) as err:
        _request(items)
    message, named = describe_validation_errors(err.value.errors(include_url=False))
    assert named == param and message.startswith(f"{param}: "), message


@pytest.mark.parametrize("case", WRONG_PART)
def test_a_part_type_its_role_does_not_take_is_refused(case):
    items, param = WRONG_PART[case]
    with pytest.raises(ProtocolError) as err:
        responses_messages(_request(items))
    assert (err.value.status, err.value.param) == (400, param)


def test_missing_field_message_names_the_item_type():
    with pytest.raises(ValidationError) as err:
        _request([{"type": "message", "role": "user"}])
    assert describe_validation_errors(err.value.errors(include_url=False)) == (
        "input.0.content: Field required when type is 'message'", "input.0.content")


def test_items_become_the_template_messages_they_say():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "A"}, {"type": "input_text",
                                                                                        "text": "B"}]},
             {"role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             CALL,
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Sunny"}]},
             {"type": "message", "role": "assistant", "id": "m", "status": "completed",
              "content": [{"type": "refusal", "refusal": "No."}]}]
    assert responses_messages(_request(items)) == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "assistant", "content": "No."},
    ]
