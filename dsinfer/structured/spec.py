"""The structured-output request, as vLLM names it: exactly one of json / json_object / regex / grammar / choice.

Parsed and checked without xgrammar, so a malformed request fails in ``SamplingParams`` (a 400 on the server)
before it reaches the engine. ``key`` identifies the compiled grammar in the cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
           "disable_fallback", "backend")
_MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # one of KINDS (json_object is kind "json" with value None)
    value: Any  # schema dict, regex / EBNF string, list of choices, structural tag dict; None for json_object
    any_whitespace: bool = True  # JSON: allow any whitespace between tokens (bounded, see backend)

    @property
    def key(self) -> str:
        """Canonical text of the constraint: equal keys share one compiled grammar."""
        value = json.dumps(self.value, sort_keys=True, separators=(",", ":"))
        return f"{self.kind}|{int(self.any_whitespace)}|{value}"


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one constraint (``json`` schema, ``regex``, ``choice``, EBNF
    ``grammar``, ``json_object`` or ``structural_tag``) and its options. ``SamplingParams(structured_outputs=...)``
    takes it or a dict of the same fields; it is checked as it is made."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        parse_structured_outputs(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        """The fields set (None and False left out), as ``SamplingParams.structured_outputs`` holds them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}


def parse_structured_outputs(raw: dict[str, Any]) -> StructuredSpec:
    """Validate the dict a user passed; raise ValueError saying what is wrong and what is allowed."""
    if not isinstance(raw, dict):
        raise ValueError(f"structured_outputs must be a dict with one of {list(KINDS)}, got {type(raw).__name__}")
    unknown = set(raw) - set(KINDS) - set(OPTIONS)
    if unknown:
        raise ValueError(f"structured_outputs has unknown field(s) {sorted(unknown)}; "
                         f"allowed: {list(KINDS)} and options {list(OPTIONS)}")
    given = [k for k in KINDS if raw.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}, got {given or 'none'}")
    kind = given[0]
    any_ws = not bool(raw.get("disable_any_whitespace", False))
    value = _check_value(kind, raw[kind])
    if kind == "json_object":
        return StructuredSpec("json", None, any_ws)
    if len(json.dumps(value)) > _MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{kind} is longer than {_MAX_SPEC_CHARS} characters")
    return StructuredSpec(kind, value, any_ws)


def _check_value(kind: str, value: Any) -> Any:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(value).__name__}")
        return value
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        return None
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        return value
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
        return list(value)
    if not isinstance(value, (dict, str)):
        raise ValueError("structured_outputs.structural_tag must be a structural tag object or JSON string")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {exc}") from None
    return value
