"""The ``pattern`` keywords of a JSON schema that xgrammar would not enforce, refused instead of ignored.

xgrammar compiles a string's ``pattern`` into its grammar, but it drops what its regex engine lacks (a lookahead
such as ``(?=a)b`` is logged as "ignored", and the output is then not held to the pattern the client asked for),
and it ignores ``pattern`` altogether on a schema without ``"type": "string"`` (an invalid regex there passed
unseen). Each pattern, and each ``patternProperties`` key, is parsed here with xgrammar's own regex parser, which
refuses lookarounds, backreferences and word boundaries: a ValueError names the pattern's place in the schema.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

_XGRAMMAR_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|cpp|h|hpp|py):\d+:\s*)?")


def xgrammar_reason(exc: BaseException) -> str:
    """The first line of an xgrammar error without its "[time] /its/source.cc:line: " prefix: the client needs
    the reason only."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__

# keywords whose value is a schema / a list of schemas / a map of names to schemas (their other values are data:
# an "enum" or "default" holding {"pattern": ...} is not a schema)
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[dict[str, Any], str]]:
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{path}.{key}"
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if isinstance(sub, dict):
                    yield sub, f"{path}.{key}[{i}]"
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if isinstance(sub, dict):
                    yield sub, f"{path}.{key}.{name}"


def _is_string_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def check_schema_patterns(schema: Any, parse_regex: Callable[[str], Any]) -> None:
    """ValueError for a ``pattern`` that ``parse_regex`` (xgrammar's ``Grammar.from_regex``) refuses or that sits
    on a schema not typed "string" (where it would be ignored); the same for ``patternProperties`` keys."""
    todo: list[tuple[Any, str]] = [(schema, "schema")]
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict):
            continue
        regexes = [(node["pattern"], f"{path}.pattern")] if isinstance(node.get("pattern"), str) else []
        if regexes and not _is_string_schema(node):
            raise ValueError(f"{path}.pattern needs \"type\": \"string\" beside it: on an untyped schema the "
                             "backend ignores the pattern instead of enforcing it")
        if isinstance(node.get("patternProperties"), dict):
            regexes += [(key, f"{path}.patternProperties key") for key in node["patternProperties"]]
        for regex, where in regexes:
            try:
                parse_regex(regex)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"{where} {regex[:200]!r} cannot be enforced: {xgrammar_reason(exc)}") from None
        todo.extend(_subschemas(node, path))
