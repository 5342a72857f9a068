"""Reasoning parser: ``<think>…</think>`` at the start of a generation becomes reasoning content.

Incremental: ``feed(delta)`` returns (reasoning delta, content delta); ``finish()`` flushes what was held
back. Models whose prompt already opened the block (the generation prompt ends with ``<think>``) start
``in_reasoning``.
"""

from __future__ import annotations

from dsinfer.protocol.streaming_text import split_at_marker

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self.state = "reasoning" if in_reasoning else "undecided"
        self._buf = ""
        self._strip_content = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        if self.state == "undecided":
            head = self._buf.lstrip()
            if head.startswith(self.start):
                self._buf, self.state = head[len(self.start) :], "reasoning"
            elif self.start.startswith(head):
                return "", ""  # still could be "<think>"
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self._buf.find(self.end)
            if i < 0:
                reasoning, self._buf = split_at_marker(self._buf, self.end)
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(self.end) :]
            self.state, self._strip_content = "content", True
        if self._strip_content:
            self._buf = self._buf.lstrip()
            self._strip_content = not self._buf
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` block."""
    return prompt_text.rstrip().endswith(THINK_START)
