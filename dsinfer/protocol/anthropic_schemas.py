"""Request schema of the Anthropic Messages API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictBool, StrictStr, ValidationInfo, field_validator, model_validator

from dsinfer.protocol.fields import MaxTokens, ShortStr, StopStr, TopK, TopP, WireModel
from dsinfer.protocol.openai_schemas import ToolName


class TextBlock(WireModel):
    type: Literal["text"]
    text: StrictStr


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


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[ContentBlock], Field(max_length=4096)]


class Tool(WireModel):
    name: ToolName
    description: Annotated[str, Field(max_length=65536)] | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: ShortStr | None = None


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


class CountTokensRequest(WireModel):
    model: ShortStr | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: StrictStr | Annotated[list[TextBlock], Field(max_length=1024)] | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: Annotated[list[StopStr], Field(max_length=16)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _above_thinking_budget(cls, value: int, info: ValidationInfo) -> int:
        thinking = info.data.get("thinking")  # validated before max_tokens (a field of the base class)
        if thinking is not None and thinking.type == "enabled" and value <= thinking.budget_tokens:
            raise ValueError(f"must be greater than thinking.budget_tokens ({thinking.budget_tokens})")
        return value
