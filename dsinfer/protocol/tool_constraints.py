"""Grammar constraints for tool calls: ``tool_choice`` "required" / a named function, and ``strict`` tools.

The constraint is an xgrammar structural tag in the Hermes/Qwen format that ``HermesToolParser`` reads back:
``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` with ARGS constrained by the function's JSON
schema. "required" / named: exactly one call is generated, then the answer ends; "auto" with ``strict`` tools:
free text, but a call that starts is forced to match its schema. Other tool formats (DeepSeek-V3) are not
constrained yet.
"""

from __future__ import annotations

import json
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


def tool_call_constraint(tools: list[Any] | None, tool_choice: Any, parser: type[ToolCallParser] | None
                         ) -> dict[str, Any] | None:
    """The ``structured_outputs`` dict that enforces the request's tool choice, or None when nothing is forced.
    A named function that is not among the tools is a 400 whatever the model's tool format."""
    if not tools or tool_choice == "none":
        return None
    by_name = {t.function.name: t.function for t in tools}
    named = tool_choice is not None and not isinstance(tool_choice, str)
    if named and tool_choice.function.name not in by_name:
        raise ProtocolError(f"tool_choice names {tool_choice.function.name!r}, which is not among the tools "
                            f"{sorted(by_name)}", param="tool_choice")
    if parser is not HermesToolParser:
        return None
    if named:
        chosen, forced = [by_name[tool_choice.function.name]], True
    elif tool_choice == "required":
        chosen, forced = list(by_name.values()), True
    else:
        chosen, forced = [f for f in by_name.values() if getattr(f, "strict", None)], False
    if not chosen:
        return None
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"],
           "tags": [_tag(f.name, f.parameters) for f in chosen], "at_least_one": forced, "stop_after_first": forced}
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}
