"""Splits one choice's generated text into reasoning, content and tool calls, incrementally."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.protocol.reasoning import ReasoningParser
from dsinfer.protocol.tool_parsers import ParsedToolCall, ToolCallParser


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: OutputDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ChatOutputParser:
    """``feed(delta_text)`` → OutputDelta; ``finish()`` → the rest. ``total`` accumulates everything.

    ``max_calls``: the calls after that many are dropped, their markup with them, as vLLM answers
    ``parallel_tool_calls`` false."""

    def __init__(
        self,
        reasoning: bool = False,
        in_reasoning: bool = False,
        tool_parser: type[ToolCallParser] | None = None,
        max_calls: int | None = None,
    ):
        self._reasoning = ReasoningParser(in_reasoning) if reasoning or in_reasoning else None
        self._tools = tool_parser() if tool_parser else None
        self._max_calls = max_calls
        self.total = OutputDelta()

    def feed(self, delta: str) -> OutputDelta:
        reasoning, content = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return self._content(reasoning, content, final=False)

    def finish(self) -> OutputDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._content(reasoning, content, final=True)

    def _content(self, reasoning: str, content: str, final: bool) -> OutputDelta:
        out = OutputDelta(reasoning=reasoning)
        if self._tools is None:
            out.content = content
        else:
            out.content, out.tool_calls = self._tools.feed(content)
            if final:
                rest, calls = self._tools.finish()
                out.content += rest
                out.tool_calls.extend(calls)
            if self._max_calls is not None:
                out.tool_calls = out.tool_calls[: max(0, self._max_calls - len(self.total.tool_calls))]
        self.total.extend(out)
        return out


def parse_output(text: str, **kwargs) -> OutputDelta:
    """Non-streaming parse of a whole generation."""
    parser = ChatOutputParser(**kwargs)
    parser.feed(text)
    parser.finish()
    return parser.total
