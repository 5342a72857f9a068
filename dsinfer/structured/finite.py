"""Which grammars can finish: a rule is *productive* when it derives at least one finite string.

A grammar whose root is not productive (``root ::= root``, ``root ::= "a" root``) accepts no output at all: a
request constrained by it could only run to ``max_tokens`` and end in "abort". ``unproductive_rules`` finds such
rules on xgrammar's normalized printing of a grammar (``str(xgr.Grammar)``: one ``name ::= body`` a line, bodies
of literals, character classes, rule names, groups, ``|``, ``*``, ``+``, ``?``, ``{m, n}`` and lookaheads
``(= ...)``), by the textbook fixpoint: a rule becomes productive once one of its alternatives consists of
terminals and productive rules only.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(\[(?:[^\]\\]|\\.)*\])|(\(=)|\{\s*(-?\d+)\s*,\s*-?\d+\s*\}'
                    r'|([A-Za-z_][A-Za-z0-9_.\-]*)|([()|*+?]))')
_LEAF, _ALWAYS = ("leaf",), ("always",)


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    body = body.rstrip()
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read the grammar's rule body at {body[pos:pos + 40]!r}")
        literal, klass, lookahead, repeat_min, name, punct = m.groups()
        if literal is not None or klass is not None:
            out.append(("leaf", ""))
        elif lookahead is not None:
            out.append(("(=", ""))
        elif repeat_min is not None:
            out.append(("repeat", repeat_min))
        elif name is not None:
            out.append(("ref", name))
        else:
            out.append((punct, ""))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.pos = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def alternatives(self) -> Any:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return ("alt", options)

    def sequence(self) -> Any:
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.item())
        return ("seq", items)

    def item(self) -> Any:
        atom = self.atom()
        while self.peek() in ("*", "?", "+", "repeat"):
            kind, value = self.tokens[self.pos]
            self.pos += 1
            if kind in ("*", "?") or (kind == "repeat" and int(value) <= 0):
                atom = _ALWAYS  # may be repeated zero times
        return atom

    def atom(self) -> Any:
        kind, value = self.tokens[self.pos]
        self.pos += 1
        if kind == "leaf":
            return _LEAF
        if kind == "ref":
            return ("ref", value)
        if kind in ("(", "(="):
            inner = self.alternatives()
            if self.peek() != ")":
                raise ValueError("unbalanced parentheses in the grammar")
            self.pos += 1
            return _ALWAYS if kind == "(=" else inner  # a lookahead consumes nothing
        raise ValueError(f"unexpected {kind!r} in the grammar")


def _derives(node: Any, productive: set[str]) -> bool:
    kind = node[0]
    if kind in ("leaf", "always"):
        return True
    if kind == "ref":
        return node[1] in productive
    if kind == "seq":
        return all(_derives(item, productive) for item in node[1])
    return any(_derives(option, productive) for option in node[1])


def unproductive_rules(printed: str) -> list[str]:
    """The rules of a printed xgrammar grammar that derive no finite string, in their printed order."""
    rules: dict[str, Any] = {}
    for line in printed.splitlines():
        if line.strip():
            name, _, body = line.partition(" ::= ")
            rules[name.strip()] = _Parser(_tokens(body)).alternatives()
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and _derives(body, productive):
                productive.add(name)
                changed = True
    return [name for name in rules if name not in productive]
