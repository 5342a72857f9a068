"""Special-token-safe chat encoding.

The template is rendered with every untrusted string (message content, tool names, descriptions, schemas,
arguments, template kwargs) replaced by a unique marker. The rendered text is split at the markers: the
template's own scaffolding is tokenized normally (so ``<|im_start|>`` there becomes its special id) and every
untrusted span is tokenized with special-token strings kept literal. A marker that went through ``tojson`` is
restored JSON-escaped. Invariant (checked): no special token id lies inside an untrusted span.

The template is also rendered once with the real strings, as HF ``apply_chat_template`` does. Most templates only
place the text, and both renderings give the same prompt. Some read or rewrite it (``| trim``, ``| upper``,
``content.split('</think>')``, ``startswith``): for those the real rendering is the right prompt and is the one
encoded, and untrusted text containing a special-token string is refused (it could not be kept literal there).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dsinfer.chat_template import render_bounded, sandboxed_environment, tojson
from dsinfer.protocol.chat_formats import tools_system_prompt
from dsinfer.protocol.errors import ProtocolError

_MARKER = re.compile(r"@@([UJ])([0-9a-f]{16})x(\d+)@@")
_RAW_MARKER = re.compile(r"@@U([0-9a-f]{16})x")


@dataclass
class EncodedChat:
    token_ids: list[int]
    text: str  # the rendered prompt with untrusted values restored
    untrusted_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token ranges


class _Markers:
    """Replaces untrusted strings by markers; ``plain``: leaves them as they are (but still records them)."""

    def __init__(self, plain: bool = False) -> None:
        self.nonce = secrets.token_hex(8)
        self.values: list[str] = []
        self.plain = plain

    def mark(self, value: str) -> str:
        if not value:
            return value
        self.values.append(value)
        return value if self.plain else f"@@U{self.nonce}x{len(self.values) - 1}@@"

    def mark_tree(self, value: Any, keys: bool = False) -> Any:
        """Mark every string in a JSON value (and every dict key when ``keys``)."""
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, dict):
            return {(self.mark(k) if keys else k): self.mark_tree(v, keys) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark_tree(v, keys) for v in value]
        return value


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter, with untrusted markers restored JSON-escaped."""
    return _RAW_MARKER.sub(r"@@J\1x", tojson(value, ensure_ascii, indent, separators, sort_keys))


def _raise(message: str) -> None:
    raise ProtocolError(f"chat template rejected the conversation: {message}")


@lru_cache(maxsize=1)
def _env():
    return sandboxed_environment(tojson=_tojson, raise_exception=_raise)


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import TemplateError

    try:
        return _env().from_string(template)
    except TemplateError as exc:
        raise ProtocolError(f"chat_template does not compile: {exc}", param="chat_template") from None


def _mark_message(m: _Markers, msg: dict[str, Any]) -> dict[str, Any]:
    out = dict(msg)
    for key in ("content", "reasoning_content", "name", "tool_call_id"):
        if isinstance(out.get(key), str):
            out[key] = m.mark(out[key])
    if out.get("tool_calls"):  # an arguments object's keys are the client's text too
        out["tool_calls"] = [
            {**tc, "id": m.mark(tc.get("id") or ""),
             "function": {**m.mark_tree(tc["function"]),
                          "arguments": m.mark_tree(tc["function"].get("arguments"), True)}}
            for tc in out["tool_calls"]
        ]
    return out


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls' JSON-text ``arguments`` parsed, as vLLM hands them to a template (and as transformers documents
    them: templates write ``arguments | tojson`` or walk ``arguments | items``); empty ones become ``{}``. Text
    that is not JSON stays text."""
    out = []
    for msg in messages:
        if msg.get("tool_calls"):
            msg = {**msg, "tool_calls": [{**tc, "function": {**tc["function"], "arguments": _parsed(
                tc["function"].get("arguments"))}} for tc in msg["tool_calls"]]}
        out.append(msg)
    return out


_MAX_ARGUMENTS_DEPTH = 64  # deeper JSON stays text: marking and rendering it would recurse past Python's limit


def _parsed(arguments: Any) -> Any:
    if not arguments:
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if _within_depth(value, _MAX_ARGUMENTS_DEPTH) else arguments


def _within_depth(value: Any, depth: int) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return True
    return depth > 0 and all(_within_depth(v, depth - 1) for v in value)


def _mark_tool(m: _Markers, tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    marked = {"name": m.mark(fn["name"]), "description": m.mark(fn.get("description") or "")}
    marked["parameters"] = m.mark_tree(fn.get("parameters") or {}, keys=True)
    return {"type": "function", "function": marked}


def ends_with_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant turn with text and no tool calls: one that can be continued."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    return last.get("role") == "assistant" and isinstance(content, str) and bool(content) and not last.get(
        "tool_calls")


class ChatEncoder:
    """Renders conversations with one template and encodes them special-token-safely."""

    def __init__(self, tokenizer: Any, template: str):
        self.tokenizer = tokenizer
        self.template = template
        self._special_ids = frozenset(tokenizer.special_token_ids)
        self._special_strings = frozenset(tokenizer.special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        plain: bool = False,
    ) -> tuple[str, _Markers]:
        """The rendered prompt with markers in place of untrusted strings (``plain``: with the strings).
        ``continue_final_message``: the last message is an assistant prefill; the prompt ends right after its text
        (no end of turn, no new turn), so the model continues it (Anthropic's prefill, vLLM's flag of that name)."""
        template = template or self.template
        m = _Markers(plain)
        if continue_final_message:
            if not ends_with_prefill(messages):
                raise ProtocolError("continuing the final message needs a last assistant message with text "
                                    "content and no tool calls", param="messages")
            add_generation_prompt = False
        if "tool_calls" not in template:  # the template knows no tools: use Hermes text for calls and results
            messages = _flatten_tool_turns(messages)
        else:
            messages = _arguments_as_objects(messages)
        if tools and "tools" not in template:  # describe the tools in the system prompt instead
            messages = _with_tools_prompt(messages, tools)
            tools = None
        ctx = {k: m.mark_tree(v) for k, v in (template_kwargs or {}).items()}
        marked = [_mark_message(m, msg) for msg in messages[:-1]]
        prefill = len(m.values)  # the marker of the last message's content (marked first)
        marked += [_mark_message(m, msg) for msg in messages[-1:]]
        ctx.update(
            messages=marked,
            tools=[_mark_tool(m, t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.tokenizer.eos_token or "",
        )
        from jinja2 import TemplateError

        try:
            rendered = render_bounded(_compile(template), ctx)
        except TemplateError as exc:
            raise ProtocolError(f"chat template failed: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError, RecursionError, OverflowError, MemoryError) as exc:
            raise ProtocolError(f"chat template cannot render this conversation: {exc}") from None
        if continue_final_message and plain:  # as HF: cut after the last place the final text appears
            final = messages[-1]["content"]
            at = rendered.rfind(final) if final in rendered else rendered.rfind(final.strip())
            if at < 0:
                raise ProtocolError("the chat template does not render the final assistant message's text, so it "
                                    "cannot be continued", param="messages")
            rendered = rendered[: at + len(final if final in rendered else final.strip())]
        elif continue_final_message:
            ends = [x.end() for x in _MARKER.finditer(rendered) if x[2] == m.nonce and int(x[3]) == prefill]
            if not ends:
                raise ProtocolError("the chat template does not render the final assistant message's text, so it "
                                    "cannot be continued", param="messages")
            rendered = rendered[: ends[-1]]
        return rendered, m

    def encode(self, messages: list[dict[str, Any]], **kwargs: Any) -> EncodedChat:
        rendered, markers = self.render(messages, **kwargs)
        encoded = self._encode_rendered(rendered, markers)
        text, plain = self.render(messages, **kwargs, plain=True)
        if text == encoded.text:
            return encoded
        # the template reads or rewrites the strings (module doc): encode the real rendering
        for value in plain.values:
            found = [(value.find(t), t) for t in self._special_strings if t in value]
            if found:
                special = min(found)[1]  # the first in the text
                raise ProtocolError(f"the text {value[:40]!r} contains the special token {special!r}, which this "
                                    "chat template rewrites text around, so it cannot be kept literal; remove it",
                                    param="messages")
        return EncodedChat(self.tokenizer.encode(text, add_special_tokens=False), text)

    def _encode_rendered(self, rendered: str, m: _Markers) -> EncodedChat:
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        text: list[str] = []
        pos = 0
        for match in _MARKER.finditer(rendered):
            if match[2] != m.nonce:
                continue
            self._encode_scaffold(rendered[pos : match.start()], ids, text)
            value = m.values[int(match[3])]
            if match[1] == "J":
                value = json.dumps(value, ensure_ascii=False)[1:-1]
            literal = self.tokenizer.encode_literal(value)
            if self._special_ids.intersection(
                literal
            ):  # encode_literal broke its contract: refuse, never pass
                raise ProtocolError("untrusted text could not be tokenized safely", status=500)
            spans.append((len(ids), len(ids) + len(literal)))
            ids.extend(literal)
            text.append(value)
            pos = match.end()
        self._encode_scaffold(rendered[pos:], ids, text)
        return EncodedChat(ids, "".join(text), spans)

    def _encode_scaffold(self, piece: str, ids: list[int], text: list[str]) -> None:
        if piece:
            ids.extend(self.tokenizer.encode(piece, add_special_tokens=False))
            text.append(piece)


def _flatten_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for msg in messages:
        if msg["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"}
            )
        elif msg.get("tool_calls"):
            # the text the model wrote: its calls one a line after any text (no newline before a first call)
            calls = [f'<tool_call>\n{{"name": "{tc["function"]["name"]}", '
                     f'"arguments": {_arguments_json(tc["function"]["arguments"])}}}\n</tool_call>'
                     for tc in msg["tool_calls"]]
            out.append({"role": msg["role"], "content": "\n".join([msg["content"], *calls] if msg.get("content")
                                                                   else calls)})
        else:
            out.append({**msg, "content": msg.get("content") or ""})
    return out


def _with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prompt = tools_system_prompt(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _arguments_json(arguments: Any) -> str:
    """A tool call's arguments as JSON text (the API's string as it is; a dict offline, dumped)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

