"""Grammar constraints for tool calls: ``tool_choice`` "required" / a named function, and ``strict`` tools.

The constraint is an xgrammar structural tag in the Hermes/Qwen format that ``HermesToolParser`` reads back:
``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` with ARGS constrained by the function's JSON
schema. "required" / named: exactly one call is generated, then the answer ends; "auto" with ``strict`` tools:
free text, but a call that starts is forced to match its schema. Other tool formats (DeepSeek-V3) are not
constrained yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.tool_parsers import HermesToolParser, ToolCallParser


def _tag(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    schema = parameters or {"type": "object"}
    return {
        "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema},
        "end": "}\n</tool_call>",
    }


@dataclass(frozen=True)
class ToolSpec:
    """A request's tool as both APIs give it: OpenAI's function, Anthropic's tool (no ``strict`` there)."""

    name: str
    parameters: dict[str, Any] | None
    strict: bool = False


def tool_call_constraint(tools: list[ToolSpec], choice: str, parser: type[ToolCallParser] | None,
                         name: str | None = None, parallel: bool = True) -> dict[str, Any] | None:
    """The ``structured_outputs`` dict that enforces the request's tool choice, or None when nothing is forced.

    ``choice``: "auto", "none", "required" (a call to some tool; Anthropic's "any") or "named" (a call to the
    tool ``name``; OpenAI's named function, Anthropic's "tool"); ``parallel`` false: the answer ends after a first
    strict call under "auto" too (``parallel_tool_calls`` false). A forced choice without tools, or a name that is
    not among the tools, is a 400 whatever the model's tool format."""
    if choice in ("required", "named") and not tools:
        raise ProtocolError("tool_choice forces a tool call, but the request has no tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    by_name = {t.name: t for t in tools}
    if choice == "named" and name not in by_name:
        raise ProtocolError(f"tool_choice names {name!r}, which is not among the tools {sorted(by_name)}",
                            param="tool_choice")
    if parser is not HermesToolParser:
        return None
    if choice == "named":
        chosen, forced = [by_name[name]], True
    elif choice == "required":
        chosen, forced = tools, True
    else:
        chosen, forced = [t for t in tools if t.strict], False
    if not chosen:
        return None
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"],
           "tags": [_tag(f.name, f.parameters) for f in chosen], "at_least_one": forced,
           "stop_after_first": forced or not parallel}
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}


def with_tool_constraint(structured: dict[str, Any] | None, field: str | None, tool: dict[str, Any] | None,
                         forced: bool, text_format: str) -> tuple[dict[str, Any] | None, str | None]:
    """(constraint, its request field) once the tool choice's constraint ``tool`` is applied. A forced call
    (``forced``: "required" or a named function) wins over the API's own output format ``text_format``
    (response_format, text.format): the call leaves no text to shape; OpenAI takes both, vLLM lets the tool win.
    Any other pair of constraints is a 400."""
    if tool is None:
        return structured, field
    if structured is not None and not (forced and field == text_format):
        raise ProtocolError(f"a forced or strict tool choice cannot be combined with {field}", param=field)
    return tool, "tools"


def forced_tool_names(tool_names: list[str], choice: str, named: str | None = None) -> tuple[str, ...]:
    """The tools a ``tool_choice`` forces the model to call from (``ChatOutputParser``'s ``forced_tools``):
    the named one ("named"), any of them ("required"), or none (the model may answer in text)."""
    if choice == "named":
        return (named,) if named else ()
    return tuple(tool_names) if choice == "required" else ()
