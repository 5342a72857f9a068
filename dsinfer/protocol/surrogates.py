"""Lone UTF-16 surrogates in JSON strings.

JSON may escape a lone surrogate (``"a\\ud800b"``; JavaScript strings can hold one, and a model can write one).
Python's parser turns it into a str that cannot be encoded to UTF-8, so a tokenizer, a log line or an answer
holding it fails. OpenAI reads it as U+FFFD; so do we, wherever such JSON is parsed: request bodies
(``server.context.parse_body``) and the tool calls a model writes (``tool_parsers``, the Anthropic ``input``).
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every surrogate in its strings, dict keys too, replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
    return value
