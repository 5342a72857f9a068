"""Strict field types shared by the request schemas.

Integer fields accept only JSON integers (no floats, strings or booleans) inside an explicit range; float
fields accept JSON integers and floats (no strings or booleans, as OpenAI's API) but never NaN/Infinity; every
field has a bound, so nothing unbounded reaches the engine.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

INT64_MAX = 2**63 - 1

StrictInt = Annotated[int, Strict()]
MaxTokens = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
EchoMaxTokens = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]  # /v1/completions: 0 with echo is allowed
NumChoices = Annotated[int, Strict(), Field(ge=1, le=128)]
# bounded by the vocabulary only: the engine's max_logprobs (--max-logprobs) is the limit, checked per request
TopLogprobs = Annotated[int, Strict(), Field(ge=0, le=1 << 31)]
PromptLogprobs = Annotated[int, Strict(), Field(ge=-1, le=1 << 31)]  # -1: the vocabulary, as vLLM
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=INT64_MAX)]
# vLLM's request priority (lower runs first; the server must run --scheduling-policy priority for any but 0)
Priority = Annotated[int, Strict(), Field(ge=-(2**31), lt=2**31)]
# a KV store traffic class (``--kv-store``'s ttl_s keys): which TTL the request's saved prefix gets
KVRetention = Annotated[str, Strict(), Field(min_length=1, max_length=64)]
TopK = Annotated[int, Strict(), Field(ge=-1, le=1 << 30)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=1 << 31)]
Temperature = Annotated[float, Strict(), Field(ge=0.0, le=1e4, allow_inf_nan=False)]
TopP = Annotated[float, Strict(), Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[float, Strict(), Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Strict(), Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Strict(), Field(gt=0.0, le=100.0, allow_inf_nan=False)]
Bias = Annotated[float, Strict(), Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
ShortStr = Annotated[str, Field(max_length=256)]
StopStr = Annotated[str, Field(min_length=1, max_length=1024)]


class WireModel(BaseModel):
    """Base of every request schema: unknown fields are ignored, NaN/Infinity are rejected, and an explicit
    ``null`` for an optional field whose type has no null (``"n": null``, as clients that serialize unset fields
    send) means its default, as in OpenAI's and Anthropic's APIs. A field whose type takes null keeps it (the
    completions' ``"max_tokens": null`` is "up to the context", not the default 16)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaults_without_null(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


def _takes_null(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _takes_null(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_takes_null(arg) for arg in typing.get_args(annotation))
    return False


@functools.cache
def _defaults_without_null(model: type[BaseModel]) -> frozenset[str]:
    """Wire names (aliases too) of ``model``'s optional fields whose type does not take null."""
    return frozenset(n for name, field in model.model_fields.items()
                     if not field.is_required() and not _takes_null(field.annotation)
                     for n in (name, field.alias, field.validation_alias) if isinstance(n, str))


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
