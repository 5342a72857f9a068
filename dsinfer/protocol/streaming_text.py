"""Helpers for parsing generated text that arrives in pieces."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (it may still become
    one).
    """
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_at_marker(buf: str, marker: str) -> tuple[str, str]:
    """Split ``buf`` into (safe to emit, keep back) so that no emitted text could start ``marker``."""
    keep = partial_suffix(buf, marker)
    return buf[: len(buf) - keep], buf[len(buf) - keep :]
