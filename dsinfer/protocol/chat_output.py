"""Splits one choice's generated text into reasoning, content and tool calls, incrementally."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.protocol.reasoning import ReasoningParser
from dsinfer.protocol.tool_parsers import ParsedToolCall, ToolCallParser


@dataclass
class ToolCallPart:
    """A piece of a streamed tool call: the first one of call ``index`` has its ``name`` (and arguments "");
    the later ones (name None) carry the next fragment of its arguments text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)  # completed in this delta
    tool_call_parts: list[ToolCallPart] = field(default_factory=list)  # the same calls, streamed as they arrive
    # the part index of each call of ``tool_calls``: tells a writer which announced call ended (the others that
    # ended, by markup that did not parse, send no more parts)
    tool_call_indexes: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls or self.tool_call_parts)

    def calls_by_index(self) -> dict[int, ParsedToolCall]:
        """The completed calls by their parts' index; those without one (a delta made by hand) by a key of their
        own (negative: no part has it)."""
        indexed = len(self.tool_call_indexes)
        return {**dict(zip(self.tool_call_indexes, self.tool_calls)),
                **{-1 - k: call for k, call in enumerate(self.tool_calls[indexed:])}}

    def split_parts(self, open_index: int | None) -> tuple[list[ToolCallPart], list[ToolCallPart]]:
        """(the parts of call ``open_index``, the one a stream has open from earlier deltas, which go before this
        delta's text since its markup came first; the other parts, which follow the text)"""
        if open_index is None:
            return [], list(self.tool_call_parts)
        own = [p for p in self.tool_call_parts if p.index == open_index]
        return own, [p for p in self.tool_call_parts if p.index != open_index]

    def extend(self, other: OutputDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        self.tool_call_parts.extend(other.tool_call_parts)
        self.tool_call_indexes.extend(other.tool_call_indexes)


class ChatOutputParser:
    """``feed(delta_text)`` → OutputDelta; ``finish()`` → the rest. ``total`` accumulates everything.

    ``max_calls``: the calls after that many are dropped, their markup with them, as vLLM answers
    ``parallel_tool_calls`` false.

    Each delta's ``tool_call_parts`` stream the calls: a call is announced (index, name) as soon as its name is
    read, then its arguments follow in fragments, each sent once it can no longer change, so that they add up to
    the finished call's ``arguments``. A call announced whose markup then fails to parse sends no more parts;
    its text is content, as in the non-streamed answer. A call the length limit cuts off (``finish(cut_off=
    True)``) ends as a call with the arguments sent so far, streamed or not. ``forced_tools``: the tool names a
    forced ``tool_choice`` allows (its grammar makes the output calls only): cut off, its markup is never content
    (``ToolCallParser.finish``)."""

    def __init__(
        self,
        reasoning: bool = False,
        in_reasoning: bool = False,
        tool_parser: type[ToolCallParser] | None = None,
        max_calls: int | None = None,
        forced_tools: tuple[str, ...] = (),
    ):
        self._forced_tools = forced_tools
        self._reasoning = ReasoningParser(in_reasoning) if reasoning or in_reasoning else None
        self._tools = tool_parser() if tool_parser else None
        self._max_calls = max_calls
        self._announced = 0  # calls given an index so far
        self._open: tuple[int, str] | None = None  # (index, arguments sent) of the call announced, not finished
        self.total = OutputDelta()

    def feed(self, delta: str) -> OutputDelta:
        reasoning, content = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return self._content(reasoning, content, final=False)

    def finish(self, cut_off: bool = False) -> OutputDelta:
        """The rest; ``cut_off``: the generation ended at its length limit (finish reason "length")."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._content(reasoning, content, final=True, cut_off=cut_off)

    def _content(self, reasoning: str, content: str, final: bool, cut_off: bool = False) -> OutputDelta:
        out = OutputDelta(reasoning=reasoning)
        if self._tools is None:
            out.content = content
        else:
            out.content, out.tool_calls = self._tools.feed(content)
            if final:
                rest, calls = self._tools.finish(cut_off, self._forced_tools)
                out.content += rest
                out.tool_calls.extend(calls)
            out.tool_call_parts, out.tool_call_indexes = self._parts(final)
            if self._max_calls is not None:
                out.tool_calls = out.tool_calls[: max(0, self._max_calls - len(self.total.tool_calls))]
                out.tool_call_indexes = out.tool_call_indexes[: len(out.tool_calls)]
                out.tool_call_parts = [p for p in out.tool_call_parts if p.index < self._max_calls]
        self.total.extend(out)
        return out

    def _parts(self, final: bool) -> tuple[list[ToolCallPart], list[int]]:
        """The parts of this delta, and the index of each call completed in it."""
        parts: list[ToolCallPart] = []
        indexes: list[int] = []
        for call in self._tools.take_ended():
            if self._open is not None:
                (index, sent), self._open = self._open, None
                # the fragments sent are a prefix of the arguments by construction (``ToolCallParser.pending``)
                if call is not None and len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                    parts.append(ToolCallPart(index, None, call.arguments[len(sent) :]))
                if call is not None:
                    indexes.append(index)
            elif call is not None:  # read whole in one delta
                parts += self._announce(call.name)
                parts.append(ToolCallPart(self._announced - 1, None, call.arguments))
                indexes.append(self._announced - 1)
        pending = None if final else self._tools.pending()
        if pending is not None:
            name, arguments = pending
            if self._open is None:
                parts += self._announce(name)
                self._open = (self._announced - 1, "")
            index, sent = self._open
            if len(arguments) > len(sent) and arguments.startswith(sent):
                parts.append(ToolCallPart(index, None, arguments[len(sent) :]))
                self._open = (index, arguments)
        return parts, indexes

    def _announce(self, name: str) -> list[ToolCallPart]:
        self._announced += 1
        return [ToolCallPart(self._announced - 1, name, "")]


def parse_output(text: str, cut_off: bool = False, **kwargs) -> OutputDelta:
    """Non-streaming parse of a whole generation (``cut_off``: it ended at its length limit)."""
    parser = ChatOutputParser(**kwargs)
    parser.feed(text)
    parser.finish(cut_off)
    return parser.total
