"""Maximum nesting depth of a JSON document, found by a byte scan (no parsing, no recursion).

Linear in the body size whatever it holds: a quote is a string delimiter unless an odd run of backslashes
precedes it, and a bracket counts only outside strings (an odd number of delimiters before it means inside).
A regex that skipped string literals took quadratic time on an unterminated string full of escaped quotes: 12.7 s
for a 64 KB body, against 0.8 ms now; an 8 MB one (the body limit) takes 0.35 s, so the guard runs large bodies
off the event loop (docs/benchmarks.md, session 9).
"""

from __future__ import annotations

import numpy as np

_DELTA = np.zeros(256, dtype=np.int8)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def _delimiters(data: np.ndarray) -> np.ndarray:
    """Where the unescaped quotes are (bool per byte)."""
    quote = data == _QUOTE
    backslash = data == _BACKSLASH
    if not backslash.any():
        return quote
    pos = np.arange(data.size, dtype=np.int32)
    last_other = np.maximum.accumulate(np.where(backslash, np.int32(-1), pos))  # last non-backslash at or before i
    run = np.zeros(data.size, dtype=np.int32)  # backslashes right before each byte
    run[1:] = pos[:-1] - last_other[:-1]
    return quote & (run % 2 == 0)


def json_depth(body: bytes) -> int:
    """Deepest bracket nesting outside string literals (an upper bound on what a JSON parser would recurse)."""
    if b"[" not in body and b"{" not in body:
        return 0
    data = np.frombuffer(body, dtype=np.uint8)
    steps = _DELTA[data]
    if b'"' in body:
        inside = np.cumsum(_delimiters(data), dtype=np.int32) % 2 == 1
        steps = np.where(inside, np.int8(0), steps)
    if not steps.any():
        return 0
    return int(np.cumsum(steps, dtype=np.int64).max())
