"""Request fields → SamplingParams, with the length and vocabulary checks the engine needs."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.protocol.errors import ProtocolError


def check_prompt_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if not token_ids:
        raise ProtocolError("the prompt is empty", param=param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def resolve_max_tokens(
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    param: str = "max_tokens",
    prompt_param: str = "messages",
    clamp: bool = False,
    default: int | None = None,
    limit: int | None = None,
) -> int:
    """The number of tokens to generate; 400 when prompt + completion exceed the context, unless ``clamp`` (a
    default the client did not ask for, like the completions' 16): then the room left.

    As vLLM's ``get_max_tokens``: an unset ``max_tokens`` takes ``default`` (the model's generation_config
    max_new_tokens), clamped to the room like any default; ``limit`` (a server-wide max_new_tokens, vLLM's
    ``override_max_tokens``) caps the result whatever the request asked."""
    resolved = _max_tokens_in_room(max_tokens, prompt_len, max_model_len, param, prompt_param, clamp, default)
    return resolved if limit is None else min(resolved, limit)


def _max_tokens_in_room(max_tokens: int | None, prompt_len: int, max_model_len: int, param: str, prompt_param: str,
                        clamp: bool, default: int | None) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} "
            f"tokens, leaving no room for a completion",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        if default is None:
            return room
        max_tokens, clamp = default, True
    if clamp:
        return min(max_tokens, room)
    if max_tokens > room:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def check_logprobs_limit(value: int | None, max_logprobs: int, param: str) -> None:
    """A 400 naming the wire field (chat's top_logprobs, the completions' logprobs) asking for more logprobs than
    the engine's max_logprobs (``--max-logprobs``) allows, as vLLM refuses it."""
    if value is not None and value > max_logprobs:
        raise ProtocolError(f"{param} must be at most {max_logprobs} (the server's --max-logprobs), got {value}",
                            param=param)


def check_prompt_logprobs(value: int | None, stream: bool, max_logprobs: int, vocab_size: int) -> None:
    """400s for vLLM's ``prompt_logprobs``: refused with ``stream`` (when it asks for any), and, -1 read as the
    vocabulary, over the server's ``--max-logprobs``."""
    if value is None:
        return
    if stream and value != 0:
        raise ProtocolError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    check_logprobs_limit(vocab_size if value == -1 else value, max_logprobs, "prompt_logprobs")


def build_sampling_params(fields: dict[str, Any], vocab_size: int, stream: bool,
                          defaults: dict[str, Any] | None = None) -> SamplingParams:
    """``fields`` uses SamplingParams names; None values (and fields the endpoint has not) take ``defaults`` (the
    server's, from the model's generation_config: vLLM's ``default_sampling_params``), then SamplingParams'."""
    kwargs = {**(defaults or {}), **{k: v for k, v in fields.items() if v is not None}}
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**kwargs)
        params.validate_for_vocab(vocab_size)
    except ValueError as exc:
        raise ProtocolError(str(exc), param=_param_of(str(exc))) from None
    return params


def _param_of(message: str) -> str | None:
    """The field a SamplingParams error names first ("top_p must be ...", "structured_outputs.json is ..."); None
    when the message starts with no field's name (never a word of prose as the param)."""
    first = message.split(" ", 1)[0]
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return first if first.split(".", 1)[0] in names else None


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    return {int(k): v for k, v in bias.items()} if bias else None
