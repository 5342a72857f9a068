"""Request schema of the Anthropic Messages API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictBool, StrictStr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dsinfer.protocol.fields import KVRetention, MaxTokens, ShortStr, StopStr, TopK, TopP, WireModel

# Anthropic takes longer tool names than OpenAI's 64 characters (MCP clients prefix server names to them); the dot
# stays allowed, as on the OpenAI routes
ToolName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]


class TextBlock(WireModel):
    type: Literal["text"]
    text: StrictStr


_REQUIRED_BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}


class ContentBlock(WireModel):
    """text, tool_use, tool_result, thinking, redacted_thinking (images/documents are refused)."""

    type: ShortStr
    text: StrictStr | None = None
    id: ShortStr | None = None
    name: ToolName | None = None
    input: dict[str, Any] | None = None
    tool_use_id: ShortStr | None = None
    content: StrictStr | Annotated[list[TextBlock], Field(max_length=1024)] | None = None
    is_error: StrictBool | None = None
    thinking: StrictStr | None = None
    signature: StrictStr | None = None

    @model_validator(mode="after")
    def _has_its_required_fields(self) -> ContentBlock:
        # one flat model for every block type: the fields Anthropic requires of a type are checked here, so the
        # converter never reads a None (a text block without text was a 500)
        for name in _REQUIRED_BLOCK_FIELDS.get(self.type, ()):
            if getattr(self, name) is None:
                raise PydanticCustomError("missing", f"{self.type} block: '{name}' is required")
        return self


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[ContentBlock], Field(max_length=4096)]


class Tool(WireModel):
    name: ToolName
    description: Annotated[str, Field(max_length=65536)] | None = None
    type: ShortStr | None = None  # before input_schema, whose validator reads it
    input_schema: dict[str, Any] | None = Field(default=None, validate_default=True)

    @field_validator("input_schema")
    @classmethod
    def _custom_tools_take_an_object(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any]:
        """A custom tool (no ``type``, or "custom") needs an object schema, as Anthropic's API; the versioned
        tools Anthropic defines (``bash_20250124``...) come without one."""
        if info.data.get("type", "custom") not in (None, "custom"):
            return value or {"type": "object"}
        if value is None:
            raise PydanticCustomError("missing", "Field required")
        if value.get("type") != "object":
            raise ValueError("the input schema's type must be 'object'")
        return value


class Metadata(WireModel):
    user_id: Annotated[StrictStr, Field(max_length=256)] | None = None


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: StrictBool | None = None


MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens


class Thinking(WireModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(strict=True, ge=0, le=1 << 30)] | None = None

    @model_validator(mode="after")
    def _enabled_has_a_budget(self) -> Thinking:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < MIN_THINKING_BUDGET):
            raise ValueError(f"budget_tokens of at least {MIN_THINKING_BUDGET} is required when thinking is enabled")
        return self


class OutputFormat(WireModel):
    """``output_config.format``: the answer is JSON that the schema accepts (Anthropic's structured outputs)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # not ``json_schema``: a key of that name must not fill it


class OutputConfig(WireModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint this server does not act on
    format: OutputFormat | None = None


class CountTokensRequest(WireModel):
    model: ShortStr | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: StrictStr | Annotated[list[TextBlock], Field(max_length=1024)] | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @field_validator("tools")
    @classmethod
    def _names_are_unique(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if tools and len({t.name for t in tools}) < len(tools):
            raise ValueError("Tool names must be unique.")  # Anthropic's message
        return tools


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: Annotated[list[StopStr], Field(max_length=16)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: StrictBool = False
    metadata: Metadata | None = None
    kv_retention: KVRetention | None = None  # the KV store's traffic class of the prompt's saved KV (--kv-store)

    @field_validator("max_tokens")
    @classmethod
    def _above_thinking_budget(cls, value: int, info: ValidationInfo) -> int:
        thinking = info.data.get("thinking")  # validated before max_tokens (a field of the base class)
        if thinking is not None and thinking.type == "enabled" and value <= thinking.budget_tokens:
            raise ValueError(f"must be greater than thinking.budget_tokens ({thinking.budget_tokens})")
        return value
