"""Protocol errors and the two error envelopes (OpenAI and Anthropic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("invalid_request_error", "not_found_error"),  # OpenAI answers an unknown model or URL so
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable_error", "overloaded_error"),
    529: ("service_unavailable_error", "overloaded_error"),  # Anthropic's "temporarily overloaded"
}


@dataclass
class ProtocolError(Exception):
    """An error to answer with ``status``; ``param`` names the offending request field when known."""

    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message


def openai_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, _TYPES[500] if status >= 500 else _TYPES[400])[0]
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str, request_id: str | None = None) -> dict:
    """Anthropic's envelope; ``request_id`` (its ``request-id`` header's ``req_...``) is in the body too, as
    Anthropic's API sends it, in-stream ``error`` events included."""
    kind = _TYPES.get(status, _TYPES[500] if status >= 500 else _TYPES[400])[1]
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_body(
    family: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    request_id: str | None = None,
) -> dict:
    """The envelope of route family ``family`` ("openai" or "anthropic"); ``request_id`` goes in Anthropic's only
    (OpenAI's envelope has no such field: its id is the ``x-request-id`` header alone)."""
    if family == "anthropic":  # no param field in its envelope: the message names the field, as Anthropic's do
        if param and not message.startswith(param):
            message = f"{param}: {message}"
        return anthropic_error_body(status, message, request_id)
    return openai_error_body(status, message, param, code)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "body"})


def _is_union_tag(part: object) -> bool:
    """pydantic puts the union branch in ``loc`` ("str", "list[constrained-int]", ...): not a field name."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one message and the dotted name of the first bad field."""
    if not errors:
        return "invalid request", None
    # the deepest error (the union branch that got furthest); among equals, one that is not a plain type
    # mismatch (a 17-entry stop list is "at most 16 items", not "should be a valid string")
    first = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")))
    loc = [str(p) for p in first.get("loc", ()) if not _is_union_tag(p)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    kind = first.get("type")
    if kind == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    where = f"{param}: " if param else ""
    if kind == "missing":  # its "input" is the enclosing object, not the field
        return f"{where}{message}", param
    if kind == "value_error":  # our own validators' messages, without pydantic's prefix
        message = message.removeprefix("Value error, ")
    value = first.get("input")
    if kind == "value_error" and not isinstance(value, int | float | str | bool):
        return f"{where}{message}", param  # a check of a whole list or object: its type says nothing more
    shown = (
        repr(value) if isinstance(value, int | float | str | bool) or value is None else type(value).__name__
    )
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{where}{message} (got {shown})", param
