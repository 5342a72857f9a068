"""Request schema of the OpenAI Responses API (stateless: ``store`` is accepted and ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr

from dsinfer.protocol.fields import MaxTokens, Seed, ShortStr, Temperature, TopLogprobs, TopP, WireModel
from dsinfer.protocol.openai_schemas import ToolName


class InputText(WireModel):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: StrictStr = ""


class InputItem(WireModel):
    """One input item: a message, a function call the model made, or that call's output."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: StrictStr | Annotated[list[InputText], Field(max_length=1024)] | None = None
    call_id: ShortStr | None = None
    name: ToolName | None = None
    arguments: StrictStr | None = None
    output: StrictStr | None = None


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
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(WireModel):
    format: TextFormat | None = None


class ResponsesRequest(WireModel):
    model: ShortStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: StrictStr | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    seed: Seed | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    text: TextConfig | None = None
    parallel_tool_calls: StrictBool = True
    stream: StrictBool = False
    store: StrictBool = False
    previous_response_id: ShortStr | None = None
    metadata: dict[str, Any] | None = None
    user: Annotated[str, Field(max_length=1024)] | None = None
