"""Maximum nesting depth of a JSON document, found by a byte scan (no parsing, no recursion)."""

from __future__ import annotations

import re

import numpy as np

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DELTA = np.zeros(256, dtype=np.int8)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes) -> int:
    """Deepest bracket nesting outside string literals (an upper bound on what a JSON parser would recurse).
    """
    if b"[" not in body and b"{" not in body:
        return 0
    stripped = _STRING.sub(b'""', body) if b'"' in body else body
    steps = _DELTA[np.frombuffer(stripped, dtype=np.uint8)]
    if not steps.any():
        return 0
    return int(np.cumsum(steps, dtype=np.int64).max())
