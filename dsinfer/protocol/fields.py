"""Strict field types shared by the request schemas.

Integer fields accept only JSON integers (no floats, strings or booleans) inside an explicit range; float
fields accept integers and floats but never NaN/Infinity; every field has a bound, so nothing unbounded
reaches the engine.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

INT64_MAX = 2**63 - 1

StrictInt = Annotated[int, Strict()]
MaxTokens = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
NumChoices = Annotated[int, Strict(), Field(ge=1, le=128)]
TopLogprobs = Annotated[int, Strict(), Field(ge=0, le=20)]
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=INT64_MAX)]
TopK = Annotated[int, Strict(), Field(ge=-1, le=1 << 30)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=1 << 31)]
Temperature = Annotated[float, Field(ge=0.0, le=1e4, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
ShortStr = Annotated[str, Field(max_length=256)]
StopStr = Annotated[str, Field(min_length=1, max_length=1024)]


class WireModel(BaseModel):
    """Base of every request schema: unknown fields are ignored, NaN/Infinity are rejected."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
