"""Request schema of the OpenAI Responses API (stateless: ``store`` is accepted and ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dsinfer.protocol.fields import (
    KVRetention,
    MaxTokens,
    Priority,
    Seed,
    ShortStr,
    Temperature,
    TopLogprobs,
    TopP,
    WireModel,
)
from dsinfer.protocol.openai_schemas import ToolName

# Each input item type's required fields, as the openai SDK's input item types (``ResponseInputItemParam``) have
# them and OpenAI's API refuses without ("Missing required parameter"): a message's role and content (no default
# role), a call's id, name and arguments, a call output's output (its ``call_id`` is optional in the SDK's
# ``FunctionCallOutput``), a reasoning item's id and summary; and each content part's text.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("output",),
    "reasoning": ("id", "summary"),
    "input_text": ("text",),
    "output_text": ("text",),
    "reasoning_text": ("text",),
    "refusal": ("refusal",),
}


def _required_by_type(value: Any, info: ValidationInfo) -> Any:
    """A field its object's ``type`` requires: absent or null, it is missing (a 400 naming the field's path).
    ``type`` is declared first, so it is validated before: when it is invalid, only it is reported."""
    kind = info.data.get("type")
    if value is None and info.field_name in _REQUIRED.get(kind, ()):
        raise PydanticCustomError("missing", "Field required when type is '{kind}'", {"kind": kind})
    return value


class ContentPart(WireModel):
    """A part of a message's, a call output's or a reasoning item's content. ``output_text`` and ``refusal`` are an
    assistant's (the SDK's ``ResponseOutputMessageParam``), ``reasoning_text`` a reasoning item's: the conversion
    checks which part goes where, and refuses image and file parts (text only)."""

    type: Literal["input_text", "output_text", "refusal", "reasoning_text", "input_image", "input_file"]
    text: StrictStr | None = Field(None, validate_default=True)
    refusal: StrictStr | None = Field(None, validate_default=True)

    _required = field_validator("text", "refusal")(_required_by_type)


class SummaryText(WireModel):
    type: Literal["summary_text"]
    text: StrictStr


Parts = Annotated[list[ContentPart], Field(max_length=1024)]


class InputItem(WireModel):
    """One input item: a message, a function call the model made, that call's output, or reasoning (skipped).
    ``type`` defaults to a message, as the SDK's ``EasyInputMessageParam``."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = Field(None, validate_default=True)
    content: StrictStr | Parts | None = Field(None, validate_default=True)
    id: ShortStr | None = Field(None, validate_default=True)
    call_id: ShortStr | None = Field(None, validate_default=True)
    name: ToolName | None = Field(None, validate_default=True)
    arguments: StrictStr | None = Field(None, validate_default=True)
    output: StrictStr | Parts | None = Field(None, validate_default=True)
    summary: Annotated[list[SummaryText], Field(max_length=1024)] | None = Field(None, validate_default=True)

    _required = field_validator("role", "content", "id", "call_id", "name", "arguments", "output",
                                "summary")(_required_by_type)


class FunctionTool(WireModel):
    type: Literal["function"]
    name: ToolName
    description: Annotated[str, Field(max_length=65536)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(WireModel):
    type: Literal["function"]
    name: ToolName


class TextFormat(WireModel):
    """``text.format``: plain text, any JSON object, or JSON under a schema (the schema sits in the format itself,
    not under ``json_schema`` as in chat's ``response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: ShortStr | None = None
    description: Annotated[str, Field(max_length=65536)] | None = None
    # ``schema_``, not ``json_schema``: the models take fields by name too, and a chat-style ``json_schema`` key
    # (the wrapper object) would otherwise become the schema
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _json_schema_is_named(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError('a "json_schema" format needs its "name"')
        return self


class TextConfig(WireModel):
    format: TextFormat | None = None


# ``include``'s values (the openai SDK's ``ResponseIncludable``); only the output logprobs change an answer here:
# the others name tools and inputs this server does not have, and add nothing
INCLUDABLE = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
]


class ResponsesRequest(WireModel):
    model: ShortStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: StrictStr | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: Annotated[list[INCLUDABLE], Field(max_length=16)] | None = None
    seed: Seed | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    text: TextConfig | None = None
    parallel_tool_calls: StrictBool = True
    stream: StrictBool = False
    store: StrictBool = False
    previous_response_id: ShortStr | None = None
    # stateful or stored features this server does not have: read so that a request using them gets a 400 rather
    # than an answer that silently lacks them
    conversation: ShortStr | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: StrictBool = False
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, Any] | None = None
    user: Annotated[str, Field(max_length=1024)] | None = None
    priority: Priority = 0  # vLLM's: lower runs first, under --scheduling-policy priority
    kv_retention: KVRetention | None = None  # the KV store's traffic class of the prompt's saved KV (--kv-store)

    @property
    def output_logprobs(self) -> int | None:
        """How many alternatives each output token's logprob entry lists, None when the request did not include
        ``message.output_text.logprobs`` (as OpenAI and vLLM: ``top_logprobs`` alone returns none)."""
        if "message.output_text.logprobs" not in (self.include or ()):
            return None
        return self.top_logprobs or 0
