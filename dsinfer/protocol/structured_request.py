"""Structured-output constraints of an OpenAI-style request: ``response_format``, vLLM's ``structured_outputs``
and the older ``guided_*`` fields, merged into the one ``SamplingParams.structured_outputs`` dict.

At most one source may be set. ``check_grammar_syntax`` parses the constraint with xgrammar (no tokenizer needed,
milliseconds) so that an invalid schema, regex or grammar is a 400 before the engine sees the request; it runs in
a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from dsinfer.protocol.errors import ProtocolError
from dsinfer.structured.finite import unproductive_rules
from dsinfer.structured.lark import grammar_from_text
from dsinfer.structured.schema_patterns import check_schema_patterns, xgrammar_reason

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(response_format: Any) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    schema = (response_format.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise ProtocolError("response_format.json_schema.schema must be a JSON schema object",
                            param="response_format.json_schema")
    return {"json": schema}


def text_format_constraint(fmt: Any) -> dict[str, Any] | None:
    """The constraint of the Responses API's ``text.format`` (None for plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if not isinstance(fmt.schema_, dict):
        raise ProtocolError("text.format.schema must be a JSON schema object", param="text.format.schema")
    return {"json": fmt.schema_}


def structured_outputs_of(req: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(the constraint dict, the request field it came from) or (None, None)."""
    sources: list[tuple[str, dict[str, Any]]] = []
    from_format = _from_response_format(getattr(req, "response_format", None))
    if from_format is not None:
        sources.append(("response_format", from_format))
    if getattr(req, "structured_outputs", None) is not None:
        sources.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in _GUIDED.items():
        value = getattr(req, field, None)
        if value is None:
            continue
        if field == "guided_json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ProtocolError(f"guided_json is not valid JSON: {exc}", param=field) from None
        sources.append((field, {kind: value}))
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise ProtocolError(f"set at most one structured-output constraint, got {names}", param=names[1])
    return (sources[0][1], sources[0][0]) if sources else (None, None)


@functools.cache
def _tiny_compiler() -> Any:
    """A grammar compiler for a three-token vocabulary: compiling against it takes well under a millisecond."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2]), max_threads=1,
                               cache_enabled=False)


def check_grammar_syntax(constraint: dict[str, Any]) -> None:
    """Parse the constraint with xgrammar, then compile it; raise ValueError naming what is wrong.

    Parsing alone lets some invalid schemas through (``"minLength": -1`` becomes a repetition ``{-1, -1}``) that
    xgrammar only refuses while compiling, which happens in the engine's step, where the error killed the engine
    for every request. Compiling against a tiny vocabulary runs the same grammar checks for the cost of a parse."""
    import xgrammar as xgr

    try:
        grammar = None
        if "json" in constraint:
            schema = constraint["json"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            check_schema_patterns(schema, xgr.Grammar.from_regex)
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        elif "regex" in constraint:
            grammar = xgr.Grammar.from_regex(constraint["regex"])
        elif "grammar" in constraint:
            grammar = grammar_from_text(constraint["grammar"])  # EBNF, or Lark translated to it
            if "root" in unproductive_rules(str(grammar)):
                raise ValueError("the grammar can never finish: its root derives no finite string (every "
                                 "alternative recurses without end)")
        elif "structural_tag" in constraint:
            tag = constraint["structural_tag"]
            grammar = xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        if grammar is not None:
            _tiny_compiler().compile_grammar(grammar)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports parse errors as RuntimeError
        kind = next(iter(constraint))
        reason = xgrammar_reason(exc)
        raise ValueError(f"invalid {kind} constraint: {reason[:500]}") from None


async def validate_structured_outputs(constraint: dict[str, Any] | None, field: str | None) -> None:
    if constraint is None:
        return
    try:
        await asyncio.to_thread(check_grammar_syntax, constraint)
    except ValueError as exc:
        raise ProtocolError(str(exc), param=field) from None
