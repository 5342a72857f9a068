"""Tool-call parsers for generated text: DeepSeek-V3 and Hermes/Qwen ``<tool_call>`` JSON.

Both are incremental: ``feed(delta)`` returns (content delta, tool calls completed in this delta) and holds
back text that may be the start of a tool-call marker; ``finish()`` flushes. Non-streaming parsing is feed +
finish. Text that looks like a tool call but does not parse is returned as content, never dropped.

For streaming a call in pieces, ``pending()`` tells the call being read: its name once known and the part of
its arguments text that can no longer change (a prefix of the ``arguments`` the finished call will have);
``take_ended()`` tells, in order, how each call read since the last look ended (the call, or None when its
markup did not parse and went out as content).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from dsinfer.protocol.streaming_text import partial_suffix, split_at_marker
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
        self._ended: list[ParsedToolCall | None] = []
        self._reset_pending()

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
            else:
                self._reset_pending()  # the head moved on: a call read next starts from scratch
        return "".join(content), calls

    def finish(self, cut_off: bool = False, forced_names: tuple[str, ...] = ()) -> tuple[str, list[ParsedToolCall]]:
        """The text held back, as content. ``cut_off`` (the generation hit its length limit): a call whose name
        was read but not its end is a call with the arguments read so far, as OpenAI answers a call that
        max_tokens cuts short; a stream has announced it and sent those arguments already.

        ``forced_names``: the tools a forced ``tool_choice`` (a named one, or "required") lets the model call;
        its grammar makes the whole output calls, so cut-off markup is never content: cut before the name was
        read, it is a call of the one tool whose name fits what was read (arguments ""), or nothing."""
        rest, self._buf = self._buf, ""
        head = rest.lstrip()
        pending = self._pending(head) if cut_off and self._in_calls and head else None
        if pending is None and cut_off and forced_names and head:
            read = self._name_read(head) if self._in_calls else ""
            fitting = [name for name in forced_names if read is not None and name.startswith(read)]
            pending = (fitting[0], "") if len(fitting) == 1 else None
            if pending is None:
                return "", []
        if pending is not None:
            call = ParsedToolCall(*pending)
            self._ended.append(call)
            return "", [call]
        return rest, []

    def _name_read(self, head: str) -> str | None:
        """The start of the name of the call being read (before ``_pending`` knows it whole): "" when none of it
        has come yet, None when the text is no call of this format."""
        return ""

    def pending(self) -> tuple[str, str] | None:
        """(name, arguments so far) of the call being read, once its name is known; else None."""
        head = self._buf.lstrip()
        return self._pending(head) if self._in_calls and head else None

    def take_ended(self) -> list[ParsedToolCall | None]:
        ended, self._ended = self._ended, []
        return ended

    def _end_call(self, call: ParsedToolCall | None, markup: str, content: list[str],
                  calls: list[ParsedToolCall]) -> None:
        self._ended.append(call)
        if call is None:
            content.append(markup)
        else:
            calls.append(call)

    def _pending(self, head: str) -> tuple[str, str] | None:
        return None

    def _reset_pending(self) -> None:
        self._pending_state: _JsonEcho | None = None  # what ``_pending`` read of the current call, if it keeps any

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

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SCALAR = frozenset("0123456789+-.eEtrufalsnINiy")  # numbers and the literals json.loads reads


class _JsonEcho:
    """Reads a Hermes call body ``{"name": ..., "arguments": {...}}`` as it arrives: ``name`` once its string is
    complete, and ``args``, the arguments object re-encoded as ``_arguments_text`` writes it
    (``json.dumps(..., ensure_ascii=False)``) up to the last token that cannot change. The finished call's text
    starts with ``args``, since the re-encoding goes token by token and character by character (escapes
    decoded, a lone surrogate as U+FFFD as ``without_surrogates``). Arguments given as a JSON string are not
    streamed; a duplicate key, whose last value json.loads keeps, stops the streaming (what was sent may differ
    from the answer then; models do not write them). Text that is no JSON stops it too: the call will not parse.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.args = ""
        self.fed = 0  # how much of the body was read
        self._stop = False
        self._stack: list[list] = []  # open containers: [kind, keys seen, current key]
        self._state = "value"
        self._capture = False  # inside the arguments object
        self._is_key = False
        self._text: list[str] = []  # the decoded string being read
        self._hex = ""
        self._high = ""  # a high surrogate that waits for its low half
        self._scalar = ""

    def feed(self, text: str) -> None:
        for ch in text:
            if self._stop or self._state == "done":
                return
            self._char(ch)

    def _emit(self, text: str) -> None:
        if self._capture:
            self.args += text

    def _char(self, ch: str) -> None:
        state = self._state
        if state == "string":
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self._state = "escape"
            elif ch < " ":
                self._stop = True  # json.loads refuses a raw control character
            else:
                self._put(ch)
        elif state == "escape":
            if ch == "u":
                self._state, self._hex = "hex", ""
            elif ch in _ESCAPES:
                self._state = "string"
                self._put(_ESCAPES[ch])
            else:
                self._stop = True
        elif state == "hex":
            self._hex += ch
            if len(self._hex) == 4:
                self._state = "string"
                try:
                    self._put_unit(chr(int(self._hex, 16)))
                except ValueError:
                    self._stop = True
        elif state == "scalar" and ch in _SCALAR:
            self._scalar += ch
        elif state == "scalar":
            try:
                value = json.loads(self._scalar)
            except ValueError:
                self._stop = True
                return
            self._emit(json.dumps(value))
            self._state = "after"
            self._after_value()
            self._char(ch)
        elif ch in " \t\r\n":
            return
        elif state in ("value", "first value"):
            self._value(ch)
        elif state in ("key", "first key"):
            if ch == "}" and state == "first key":
                self._close("{")
            elif ch == '"':
                self._start_string(key=True)
            else:
                self._stop = True
        elif state == "colon":
            if ch == ":":
                self._emit(": ")
                self._state = "value"
            else:
                self._stop = True
        elif state == "after":
            kind = self._stack[-1][0]
            if ch == ",":
                self._emit(", ")
                self._state = "key" if kind == "{" else "value"
            elif ch == {"{": "}", "[": "]"}[kind]:
                self._close(kind)
            else:
                self._stop = True

    def _value(self, ch: str) -> None:
        top = self._stack[0] if self._stack else None
        if len(self._stack) == 1 and top[2] == "arguments":
            self._capture = ch == "{"  # arguments as a JSON string are sent whole, once the call is complete
        if ch == "{":
            self._emit("{")
            self._stack.append(["{", set(), None])
            self._state = "first key"
        elif ch == "[":
            self._emit("[")
            self._stack.append(["[", set(), None])
            self._state = "first value"
        elif ch == '"':
            self._start_string(key=False)
        elif ch in _SCALAR:
            self._state, self._scalar = "scalar", ch
        elif ch == "]" and self._state == "first value":
            self._close("[")
        else:
            self._stop = True

    def _close(self, kind: str) -> None:
        self._stack.pop()
        self._emit("}" if kind == "{" else "]")
        self._after_value()

    def _after_value(self) -> None:
        if not self._stack:
            self._state = "done"
            return
        self._state = "after"
        if len(self._stack) == 1:
            self._capture = False  # a top-level member ended: the arguments object, if it was this one

    def _start_string(self, key: bool) -> None:
        self._state, self._is_key, self._text = "string", key, []
        self._emit('"')

    def _put(self, ch: str) -> None:
        if self._high:  # a high surrogate not followed by its low half: lone
            self._high = ""
            self._put_unit("\ufffd")
        self._put_unit(ch)

    def _put_unit(self, ch: str) -> None:
        if "\udc00" <= ch <= "\udfff" and self._high:
            ch, self._high = (chr(0x10000 + ((ord(self._high) - 0xD800) << 10) + ord(ch) - 0xDC00)), ""
        elif self._high:
            self._high = ""
            self._put_unit("\ufffd")
        if "\ud800" <= ch <= "\udbff":
            self._high = ch  # held: its low half may follow
            return
        if "\udc00" <= ch <= "\udfff":
            ch = "\ufffd"
        self._text.append(ch)
        self._emit(json.dumps(ch, ensure_ascii=False)[1:-1])

    def _end_string(self) -> None:
        if self._high:
            self._high = ""
            self._put_unit("\ufffd")
        self._emit('"')
        text = "".join(self._text)
        frame = self._stack[-1] if self._stack else None
        if self._is_key:
            if text in frame[1]:
                self._stop = True  # json.loads keeps the last value: what was sent may be wrong, send no more
                return
            frame[1].add(text)
            frame[2] = text
            self._state = "colon"
            return
        if len(self._stack) == 1 and frame[2] == "name":
            self.name = text
        self._after_value()


# a Hermes call body cut off inside its name's string ({"name": "get_we), and the text before that string
_HERMES_NAME_SO_FAR = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)$')
_HERMES_BEFORE_NAME = '{"name":"'


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
        self._end_call(self._parse(body), head[: j + len(self.end)], content, calls)
        return True

    def _pending(self, head: str) -> tuple[str, str] | None:
        if not head.startswith(self.start):
            return None
        body = head[len(self.start) :]
        # text that may become the end marker is not the call's: a marker inside a string ends the call there
        body = body[: len(body) - partial_suffix(body, self.end)]
        if self._pending_state is None:
            self._pending_state = _JsonEcho()
        echo = self._pending_state
        echo.feed(body[echo.fed :])
        echo.fed = len(body)
        return None if echo.name is None else (echo.name, echo.args)

    def _name_read(self, head: str) -> str | None:
        if not head.startswith(self.start):
            return "" if self.start.startswith(head) else None
        body = head[len(self.start) :]
        match = _HERMES_NAME_SO_FAR.match(body)
        if match is not None:
            return match["name"]
        return "" if _HERMES_BEFORE_NAME.startswith("".join(body.split())) else None

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
_DS_V3_OPEN = re.compile(r"```(?:json)?\n")
_DS_V31 = re.compile(r"^(?P<name>[^\n<]+)" + _DS_SEP + r"(?P<args>.*)$", re.DOTALL)


def _ds_v3_args(text: str) -> str:
    """The part of a V3 call's fenced arguments ``text`` (so far) that stays in them: the fence that closes them
    (``\\n```\\s*`` at the end) may be arriving, and they are stripped."""
    t = text.strip()
    ticks = len(t) - len(t.rstrip("`"))
    if 0 < ticks <= 3 and t[: len(t) - ticks].endswith("\n"):
        t = t[: len(t) - ticks].rstrip()
    return t


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
        call = None if match is None or args is None else ParsedToolCall(match["name"].strip(), args)
        self._end_call(call, head[: j + len(_DS_CALL_END)], content, calls)
        return True

    def _pending(self, head: str) -> tuple[str, str] | None:
        if not head.startswith(_DS_CALL_BEGIN):
            return None
        body = head[len(_DS_CALL_BEGIN) :]
        body = body[: len(body) - partial_suffix(body, _DS_CALL_END)]
        i = body.find(_DS_SEP)
        if i < 0 or "\n" in body[:i] or "<" in body[:i]:
            return None
        rest = body[i + len(_DS_SEP) :]
        if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>ARGS (a V3 name line never starts with "{")
            name, args = body[:i].strip(), rest.strip()
            return (name, args) if name else None
        nl = rest.find("\n")
        opening = _DS_V3_OPEN.match(rest, nl + 1) if nl >= 0 else None
        if opening is None:  # the fence line is not all there yet, or this is no V3 call
            return None
        return rest[:nl].strip(), _ds_v3_args(rest[opening.end() :])

    def _name_read(self, head: str) -> str | None:
        if not head.startswith(_DS_CALL_BEGIN):
            return "" if _DS_CALL_BEGIN.startswith(head) else None
        body = head[len(_DS_CALL_BEGIN) :]
        i = body.find(_DS_SEP)
        if i < 0:  # V3's "function" (or V3.1's name) before the separator: which, it cannot yet tell
            return ""
        return body[i + len(_DS_SEP) :].split("\n", 1)[0].strip()


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
}


def tool_parser_for(name: str, special_tokens: frozenset[str]) -> type[ToolCallParser]:
    """``name`` is a key of TOOL_PARSERS or "auto" (DeepSeek-V3 when the vocabulary has its markers)."""
    if name == "auto":
        name = "deepseek_v3" if _DS_CALLS_BEGIN in special_tokens else "hermes"
    return TOOL_PARSERS[name]
