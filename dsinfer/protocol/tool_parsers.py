"""Tool-call parsers for generated text: DeepSeek-V3 and Hermes/Qwen ``<tool_call>`` JSON.

Both are incremental: ``feed(delta)`` returns (content delta, tool calls completed in this delta) and holds
back text that may be the start of a tool-call marker; ``finish()`` flushes. Non-streaming parsing is feed +
finish. Text that looks like a tool call but does not parse is returned as content, never dropped.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from dsinfer.protocol.streaming_text import split_at_marker
from dsinfer.protocol.surrogates import without_surrogates


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as text


class ToolCallParser(ABC):
    start = ""  # the text that opens the tool-call section
    markers: tuple[str, ...] = ()  # strings that must survive detokenization (skip_special_tokens=False)

    def __init__(self) -> None:
        self._buf = ""
        self._in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self._buf += delta
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_calls:
                i = self._buf.find(self.start)
                if i < 0:
                    emit, self._buf = split_at_marker(self._buf, self.start)
                    content.append(emit)
                    break
                content.append(self._buf[:i])
                self._buf, self._in_calls = self._buf[i:], True
            elif not self._step(content, calls):
                break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self._buf = self._buf, ""
        return rest, []

    @abstractmethod
    def _step(self, content: list[str], calls: list[ParsedToolCall]) -> bool:
        """Consume one unit of the tool-call section; False when more text is needed."""

    def _leave_calls(self, head: str) -> bool:
        if any(m.startswith(head) for m in self.markers):
            return False  # a marker may still be arriving
        self._in_calls = False  # plain text after the calls: content again (whitespace kept)
        return True


def _arguments_text(args: object) -> str | None:
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return None


class HermesToolParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, possibly several in a row."""

    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start,)

    def _step(self, content: list[str], calls: list[ParsedToolCall]) -> bool:
        head = self._buf.lstrip()
        if not head:
            return False
        if not head.startswith(self.start):
            return self._leave_calls(head)
        j = head.find(self.end)
        if j < 0:
            return False
        body, self._buf = head[len(self.start) : j], head[j + len(self.end) :]
        call = self._parse(body)
        if call is None:
            content.append(head[: j + len(self.end)])
        else:
            calls.append(call)
        return True

    @staticmethod
    def _parse(body: str) -> ParsedToolCall | None:
        try:
            obj = without_surrogates(json.loads(body))  # (module doc of ``surrogates``)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = _arguments_text(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else ParsedToolCall(obj["name"], args)


_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALLS_END = "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_DS_V3 = re.compile(
    r"^[^\n<]*" + _DS_SEP + r"(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*$", re.DOTALL
)
_DS_V31 = re.compile(r"^(?P<name>[^\n<]+)" + _DS_SEP + r"(?P<args>.*)$", re.DOTALL)


class DeepSeekV3ToolParser(ToolCallParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>…``
        (and V3.1's ``NAME<｜tool▁sep｜>ARGS``).
    """

    start = _DS_CALLS_BEGIN
    markers = (_DS_CALLS_BEGIN, _DS_CALLS_END, _DS_CALL_BEGIN)

    def _step(self, content: list[str], calls: list[ParsedToolCall]) -> bool:
        head = self._buf.lstrip()
        for skip in (_DS_CALLS_BEGIN, _DS_CALLS_END):
            if head.startswith(skip):
                self._buf = head[len(skip) :]
                self._in_calls = skip == _DS_CALLS_BEGIN
                return True
        if not head:
            return False
        if not head.startswith(_DS_CALL_BEGIN):
            return self._leave_calls(head)
        j = head.find(_DS_CALL_END)
        if j < 0:
            return False
        body, self._buf = head[len(_DS_CALL_BEGIN) : j], head[j + len(_DS_CALL_END) :]
        match = _DS_V3.match(body) or _DS_V31.match(body)
        args = _arguments_text(match["args"].strip()) if match else None
        if match is None or args is None:
            content.append(head[: j + len(_DS_CALL_END)])
        else:
            calls.append(ParsedToolCall(match["name"].strip(), args))
        return True


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
}


def tool_parser_for(name: str, special_tokens: frozenset[str]) -> type[ToolCallParser]:
    """``name`` is a key of TOOL_PARSERS or "auto" (DeepSeek-V3 when the vocabulary has its markers)."""
    if name == "auto":
        name = "deepseek_v3" if _DS_CALLS_BEGIN in special_tokens else "hermes"
    return TOOL_PARSERS[name]
