"""Normalize OpenAI chat, Responses and Anthropic conversations to the template's message dicts.

Template messages: ``{"role", "content": str | None, "tool_calls": [...], "tool_call_id", "name"}`` with
tool-call ``arguments`` as JSON text; tools as OpenAI function tools. Only text content is accepted.
"""

from __future__ import annotations

import json
from typing import Any

from dsinfer.protocol import anthropic_schemas as an
from dsinfer.protocol import openai_schemas as oa
from dsinfer.protocol import responses_schemas as rs
from dsinfer.protocol.errors import ProtocolError

_TEXT_PARTS = ("text", "input_text", "output_text")


def _text_of(content: Any, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise ProtocolError(
                f"content part type {part.type!r} is not supported (only text)", param=f"{param}.{i}.type"
            )
        if part.text is None:
            raise ProtocolError(f"a content part of type {part.type!r} needs its \"text\" field",
                                param=f"{param}.{i}.text")
        texts.append(part.text)
    return "\n".join(texts)  # as vLLM joins an OpenAI message's text parts


def _function_tool(name: str, description: str | None, parameters: dict | None) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description or "", "parameters": parameters or {}},
    }


def openai_chat_messages(messages: list[oa.ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": _text_of(m.content, f"messages.{i}.content")}
        if m.role == "developer":
            msg["role"] = "system"
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in m.tool_calls
            ]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def openai_chat_tools(tools: list[oa.Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [_function_tool(t.function.name, t.function.description, t.function.parameters) for t in tools]


# the part types each input can hold (the SDK's content lists): an assistant's message also what the model wrote
_INPUT_PARTS = ("input_text", "input_image", "input_file")
_ALLOWED_PARTS = {"assistant": (*_INPUT_PARTS, "output_text", "refusal")}


def _responses_text(content: str | list[rs.ContentPart], param: str, role: str | None = None) -> str:
    """The text of a Responses message's content (of a call's output when ``role`` is None)."""
    if isinstance(content, str):
        return content
    allowed = _ALLOWED_PARTS.get(role, _INPUT_PARTS)
    texts = []
    for j, part in enumerate(content):
        if part.type not in allowed:
            where = f"a {role} message" if role else "a function_call_output"
            raise ProtocolError(f"content part type {part.type!r} is not allowed in {where} (allowed: "
                                f"{', '.join(allowed)})", param=f"{param}.{j}.type")
        if part.type in ("input_image", "input_file"):
            raise ProtocolError(f"content part type {part.type!r} is not supported (only text)",
                                param=f"{param}.{j}.type")
        texts.append(part.refusal if part.type == "refusal" else part.text)
    return "\n".join(texts)  # as vLLM joins an OpenAI message's text parts


def responses_messages(req: rs.ResponsesRequest) -> list[dict[str, Any]]:
    """The schema has checked each item's required fields (``InputItem``); the part types are checked here."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if item.type == "message":
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _responses_text(item.content, f"input.{i}.content", item.role)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            output = _responses_text(item.output, f"input.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id or "", "content": output})
    return out


def responses_tools(req: rs.ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    return [_function_tool(t.name, t.description, t.parameters) for t in req.tools]


_BLANK_TEXT = "text content blocks must contain non-whitespace text"  # Anthropic's message


def anthropic_messages(req: an.CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(req.system, list):
        for j, block in enumerate(req.system):
            if not block.text.strip():
                raise ProtocolError(_BLANK_TEXT, param=f"system.{j}.text")
    system = (
        req.system
        if isinstance(req.system, str) or req.system is None
        else "".join(b.text for b in req.system)
    )
    if system:
        out.append({"role": "system", "content": system})
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        if not m.content and not (i == last and m.role == "assistant"):  # "" or [], as Anthropic's API
            raise ProtocolError("all messages must have non-empty content except for the optional final "
                                "assistant message", param=f"messages.{i}.content")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            param = f"messages.{i}.content.{j}"
            if block.type == "text":
                if not block.text.strip():
                    raise ProtocolError(_BLANK_TEXT, param=f"{param}.text")
                texts.append(block.text)
            elif block.type == "tool_use" and m.role == "assistant":
                calls.append(
                    {
                        "id": block.id or "",
                        "type": "function",
                        "function": {
                            "name": block.name or "",
                            "arguments": json.dumps(block.input or {}, ensure_ascii=False),
                        },
                    }
                )
            elif block.type == "tool_result" and m.role == "user":
                content = (
                    block.content
                    if isinstance(block.content, str) or block.content is None
                    else "".join(b.text for b in block.content)
                )
                out.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id or "", "content": content or ""}
                )
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier turns' reasoning is not part of the prompt
            else:
                raise ProtocolError(f"content block type {block.type!r} is not supported here", param=param)
        if texts or calls:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts) or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def anthropic_tools(req: an.CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    return [_function_tool(t.name, t.description, t.input_schema) for t in req.tools]
