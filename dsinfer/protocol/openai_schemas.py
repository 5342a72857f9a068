"""Request schemas of the OpenAI chat completions and completions APIs (plus vLLM's sampling extensions)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, ValidationInfo, field_validator, model_validator

from dsinfer.protocol.fields import (
    Bias,
    EchoMaxTokens,
    KVRetention,
    MaxTokens,
    MinP,
    NumChoices,
    Penalty,
    Priority,
    PromptLogprobs,
    RepetitionPenalty,
    Seed,
    ShortStr,
    StopStr,
    Temperature,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
    WireModel,
)

ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
Stop = StopStr | Annotated[list[StopStr], Field(max_length=16)] | None


class ContentPart(WireModel):
    type: ShortStr
    text: StrictStr | None = None


class FunctionCall(WireModel):
    name: ToolName
    arguments: StrictStr = "{}"


class ToolCall(WireModel):
    id: ShortStr = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[ContentPart], Field(max_length=1024)] | None = None
    name: ShortStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: ShortStr | None = None
    reasoning_content: StrictStr | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # as OpenAI: only an assistant turn that calls tools may leave its content out (or null)
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content"
                             + (" (or tool_calls)" if self.role == "assistant" else ""))
        return self


class FunctionDef(WireModel):
    name: ToolName
    description: Annotated[str, Field(max_length=65536)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # constrain this function's arguments to its schema


class Tool(WireModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(WireModel):
    class _Name(WireModel):
        name: ToolName

    type: Literal["function"] = "function"
    function: _Name


class StreamOptions(WireModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(WireModel):
    """Fields common to chat and text completions."""

    model: ShortStr | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    n: NumChoices = 1
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    max_tokens: MaxTokens | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=1 << 30)] = 0
    logit_bias: Annotated[dict[str, Bias], Field(max_length=4096)] | None = None
    # vLLM extras: sample only these tokens; never generate these words
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 18)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                         Field(max_length=1024)] | None = None
    # vLLM's: the prompt's logprobs, k alternatives a position (-1: the vocabulary); not with stream, as vLLM
    prompt_logprobs: PromptLogprobs | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # vLLM's: keep the prompt's last k tokens; -1 as many as leave room for one output token
    truncate_prompt_tokens: Annotated[int, Field(strict=True, ge=-1, le=1 << 30)] | None = None
    user: Annotated[str, Field(max_length=1024)] | None = None
    priority: Priority = 0  # vLLM's: lower runs first, under --scheduling-policy priority
    kv_retention: KVRetention | None = None  # the KV store's traffic class of the prompt's saved KV (--kv-store)
    # vLLM's: logprobs tokens as "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: StrictBool | None = None
    # vLLM's: each choice also holds its output token ids (``token_ids``), in the non-streamed answer
    return_token_ids: StrictBool = False
    # vLLM-style structured outputs (at most one of these and response_format)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Annotated[str, Field(max_length=1 << 20)] | None = None
    guided_regex: Annotated[str, Field(min_length=1, max_length=65536)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=65536)]],
                             Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1, max_length=1 << 20)] | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _no_zero_truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be >= 1 or -1")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None
    chat_template: Annotated[str, Field(max_length=1 << 20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's: the last (assistant) message is continued, not closed
    echo: StrictBool = False  # vLLM's: the answer starts with the last message's text when the roles match


# a batch is one engine request per prompt, each with n choices: their count, prompts x n, has n's cap
MAX_BATCH_CHOICES = 128
Prompt = (
    StrictStr
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[StrictStr], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # 0 only with echo: the prompt back (scored when logprobs asks), nothing generated (lm-eval's loglikelihood)
    max_tokens: EchoMaxTokens | None = 16
    logprobs: TopLogprobs | None = None
    echo: StrictBool = False
    best_of: NumChoices | None = None
    suffix: StrictStr | None = None
    response_format: ResponseFormat | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch(cls, prompt: Any, info: ValidationInfo) -> Any:
        """A batch (a list of strings or of token-id lists) is checked before its items: its size first, so a
        huge one is refused without parsing it, and a mix of both kinds gets a plain message, not a union's."""
        if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], str | list):
            return prompt
        n = info.data.get("n", 1)  # n comes first; when it is invalid its own error is the one reported
        if len(prompt) * n > MAX_BATCH_CHOICES:
            raise ValueError(f"a batch of {len(prompt)} prompts with n={n} asks for {len(prompt) * n} choices; "
                             f"at most {MAX_BATCH_CHOICES} (prompts x n) are allowed")
        if not all(isinstance(p, type(prompt[0])) for p in prompt):
            raise ValueError("a batch of prompts must be all strings or all lists of token ids")
        return prompt
