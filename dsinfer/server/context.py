"""ServingContext: what every route needs — the engine, settings, metrics and the model's chat protocol."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from dsinfer.entrypoints.async_engine import AsyncEngine
from dsinfer.protocol.chat_encoding import ChatEncoder, EncodedChat
from dsinfer.protocol.chat_formats import serving_template
from dsinfer.protocol.errors import ProtocolError, describe_validation_errors
from dsinfer.protocol.reasoning import THINK_START, prompt_opens_reasoning
from dsinfer.protocol.sampling import resolve_max_tokens
from dsinfer.protocol.surrogates import without_surrogates
from dsinfer.protocol.tool_parsers import ToolCallParser, tool_parser_for
from dsinfer.server.metrics import ServerMetrics
from dsinfer.server.settings import ServerSettings


def new_id(prefix: str) -> str:
    """A server-made id; clients never choose request ids."""
    return f"{prefix}{uuid.uuid4().hex}"


PROMPT_BYTES_MARGIN = 2  # check_prompt_text's factor over the bytes the longest tokens of a full context hold


class ServingContext:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(self.model_name)
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size: int = min(self.tokenizer.vocab_size, engine.model_config.vocab_size or 1 << 31)
        # vLLM's default_sampling_params (--generation-config, --override-generation-config): what the sampling
        # fields a request leaves unset take; max_tokens goes through max_tokens() instead, as it meets the room left
        defaults = dict(engine.model_config.sampling_defaults)
        self.default_max_tokens: int | None = defaults.pop("max_tokens", None)
        self.sampling_defaults: dict[str, Any] = defaults
        self.max_tokens_limit: int | None = engine.model_config.max_tokens_limit
        self.max_logprobs: int = engine.model_config.logprobs_limit  # --max-logprobs, -1 resolved
        special = frozenset(self.tokenizer.special_tokens)
        self.chat = ChatEncoder(self.tokenizer, serving_template(self.tokenizer, settings.chat_template,
                                                                 settings.chat_format))
        self.tool_parser: type[ToolCallParser] = tool_parser_for(settings.tool_call_parser, special)
        self.tool_markers_special = any(m in special for m in self.tool_parser.markers)
        has_think = self.tokenizer.token_to_id(THINK_START) is not None
        self.reasoning = settings.reasoning_parser == "think" or (
            settings.reasoning_parser == "auto" and has_think
        )

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """400 before tokenizing a text too long for the context whatever its tokens: more UTF-8 bytes than
        ``PROMPT_BYTES_MARGIN`` x max_model_len x the longest token's bytes (the margin leaves room for a
        normalizer that shortens text, as NFKC's ligatures). Bounds the CPU a prompt or /tokenize can cost."""
        limit = PROMPT_BYTES_MARGIN * self.max_model_len * self.tokenizer.max_token_bytes
        if len(text) > limit // 4 and len(text.encode(errors="surrogatepass")) > limit:
            raise ProtocolError(f"the text is too long for the model's context of {self.max_model_len} tokens "
                                f"(over {limit} bytes)", param=param)

    def check_prompt_tokens(self, num_tokens: int, param: str = "prompt") -> None:
        """400 for a prompt of more tokens than the context holds."""
        if num_tokens > self.max_model_len:
            raise ProtocolError(f"the prompt has {num_tokens} tokens, more than the model's context of "
                                f"{self.max_model_len}", param=param)

    def check_priority(self, priority: int) -> None:
        """400 (param "priority") for a priority other than 0 when the engine does not schedule by priority."""
        if priority:
            try:
                self.engine.check_priority(priority)
            except ValueError as exc:
                raise ProtocolError(str(exc), param="priority") from None

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0] if self.settings.served_model_names else "default"

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names ``/v1/models`` lists: ``--served-model-name``, else the model's."""
        return tuple(self.settings.served_model_names or (self.model_name,))

    def reported_model(self, requested: str | None) -> str:
        """The model name an answer carries: the one requested when it is a served name (several
        ``--served-model-name``), else the first."""
        return requested if requested in self.served_names else self.model_name

    def check_model(self, name: str | None, strict: bool = False) -> None:
        """404 for a model this server does not serve. Requests may name any model when no
        ``--served-model-name`` is set; ``strict`` (a lookup by name) checks against ``served_names``."""
        names = self.served_names if strict else self.settings.served_model_names
        if name is not None and names and name not in names:
            raise ProtocolError(
                f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found"
            )

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprobs tokens are "token_id:N": the request's ``return_tokens_as_token_ids``, else the
        server's flag (vLLM's rule)."""
        return self.settings.return_tokens_as_token_ids if requested is None else requested

    def max_tokens(self, requested: int | None, prompt_len: int, param: str = "max_tokens",
                   prompt_param: str = "messages", clamp: bool = False) -> int:
        """``resolve_max_tokens`` with this server's generation-config default and limit."""
        return resolve_max_tokens(requested, prompt_len, self.max_model_len, param, prompt_param, clamp,
                                  default=self.default_max_tokens, limit=self.max_tokens_limit)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> EncodedChat:
        if template is not None and not self.settings.trust_request_chat_template:
            raise ProtocolError(
                "request-supplied chat templates are disabled on this server "
                "(start it with --trust-request-chat-template)",
                param="chat_template",
            )
        # off the event loop: a long conversation takes seconds to render and tokenize (a 6 MB message: ~9 s on a
        # 2-core CPU), which must not stall the other requests' streams and /health
        encoded = await asyncio.to_thread(
            self.chat.encode,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template=template,
            template_kwargs=template_kwargs,
            continue_final_message=continue_final_message,
        )
        if not encoded.token_ids:
            raise ProtocolError("the conversation renders to an empty prompt", param="messages")
        return encoded

    def prompt_has_tools(self, tools: Any, choice_is_none: bool) -> bool:
        """Whether the request's tools go into the prompt: with ``tool_choice`` "none" too (the model sees them
        but its answer is not parsed for calls, as vLLM), unless the server excludes them then."""
        return bool(tools) and not (choice_is_none and self.settings.exclude_tools_when_tool_choice_none)

    def output_parser_kwargs(self, prompt_text: str, use_tools: bool, parallel_calls: bool = True,
                             forced_tools: tuple[str, ...] = ()) -> dict[str, Any]:
        """``parallel_calls`` false (OpenAI's ``parallel_tool_calls``, Anthropic's ``disable_parallel_tool_use``):
        the answer keeps its first tool call only. ``forced_tools``: the names a forced ``tool_choice`` (named,
        "required", Anthropic's "tool" / "any") lets the model call (``ChatOutputParser``)."""
        in_reasoning = self.reasoning and prompt_opens_reasoning(prompt_text)
        return {
            "reasoning": self.reasoning,
            "in_reasoning": in_reasoning,
            "tool_parser": self.tool_parser if use_tools else None,
            "max_calls": None if parallel_calls else 1,
            "forced_tools": forced_tools if use_tools else (),
        }


# a \uD800-\uDFFF escape: a UTF-16 surrogate, lone unless its pair follows
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _replace_lone_surrogates(body: bytes) -> bytes | None:
    """The body re-encoded with each lone surrogate escape (``"a\\ud800b"``) as U+FFFD, or None when that is not
    why it failed to parse. OpenAI accepts such strings (JavaScript makes them); pydantic's parser refuses them,
    and the text could not be encoded to UTF-8 for the tokenizer, the logs or an echo anyway. Python's parser
    accepts them (it pairs the valid ones), so the body is parsed once more by it and the values cleaned."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:  # decoded first: json.loads(bytes) would also take a BOM or raw surrogate bytes, which pydantic refuses
        value = json.loads(body.decode("utf-8"))
    except ValueError:  # invalid for another reason too (UnicodeDecodeError included): the first error stands
        return None
    return json.dumps(without_surrogates(value), ensure_ascii=False).encode()


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Validate the JSON body into ``model``; every failure is a 400 naming the field."""
    body = await request.body()
    if not body.strip():
        raise ProtocolError("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    cleaned = _replace_lone_surrogates(body) if errors[0]["type"] == "json_invalid" else None
    if cleaned is not None:
        try:
            return model.model_validate_json(cleaned)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
    message, param = describe_validation_errors(errors)
    raise ProtocolError(message, param=param) from None
