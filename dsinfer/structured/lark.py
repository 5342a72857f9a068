"""Lark grammars as xgrammar EBNF, as vLLM takes them in ``structured_outputs.grammar`` (and OpenAI's CFG tools use).

xgrammar reads EBNF (``name ::= ...``, ``root`` the start). A Lark grammar (``name: ...``) is translated:

- rules (lowercase) and terminals (UPPERCASE) become EBNF rules; ``?`` / ``!`` prefixes, terminal priorities
  (``NAME.2``) and aliases (``-> name``) are dropped, as they only shape Lark's parse tree;
- ``[x]`` is ``(x)?``, ``x ~ n`` / ``x ~ n..m`` are ``x{n}`` / ``x{n,m}``, ``"a".."z"`` is ``[a-z]``, ``"abc"i``
  matches any letter case;
- a ``/regex/`` becomes rules of its own (xgrammar's regex translation; no regex flags);
- ``%import common.NAME`` (or ``common (A, B)``) brings Lark's common terminals (NUMBER, ESCAPED_STRING, WS, ...);
- ``%ignore X``: as Lark skips X between tokens, every token a rule uses may be preceded by any run of the
  ignored terminals, and so may the end of the text;
- the start rule is ``start`` when there is one, else the first rule.

Rule templates (``name{x}``), ``%declare`` / ``%override`` / ``%extend`` and other imports are a ValueError naming
the line. Generated rule names hold a ``-``, which Lark names cannot, so they never clash with the grammar's own.
"""

from __future__ import annotations

import ast
import json
import re

_TOKEN = re.compile(r"""
    (?P<space>[ \t\f\r]+) | (?P<comment>//[^\n]*) | (?P<newline>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[a-z]*)
  | (?P<directive>%[a-z]+)
  | (?P<op>->|\.\.|[:|()\[\]?!*+~{},.])
  | (?P<number>\d+)
  | (?P<name>[A-Za-z_]\w*)
""", re.VERBOSE)
_DEFINITION = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(\.-?\d+)?\s*:(?!:)", re.MULTILINE)

# Lark's common.lark terminals, each written as one regex here
COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+",
    "SIGNED_NUMBER": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)",
    "ESCAPED_STRING": r'"(\\.|[^"\\])*"',
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[a-zA-Z]", "WORD": r"[a-zA-Z]+",
    "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*",
    "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(\r?\n)+",
    "SH_COMMENT": r"#[^\n]*", "CPP_COMMENT": r"//[^\n]*", "C_COMMENT": r"/\*([^*]|\*+[^*/])*\*+/",
}
_IGNORED = "ignored-"


def looks_like_lark(grammar: str) -> bool:
    """True for Lark syntax: no EBNF ``::=`` definition, and at least one ``name:`` definition."""
    return "::=" not in grammar and bool(_DEFINITION.search(grammar))


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _ebnf_name(name: str) -> str:
    return "root-" if name == "root" else name  # "root" is the EBNF start: a Lark rule of that name moves aside


class _Translator:
    def __init__(self, regex_to_ebnf):
        self.regex_to_ebnf = regex_to_ebnf  # (pattern, rule name) -> EBNF rules defining that name
        self.rules: list[str] = []  # EBNF definitions, in order
        self.extra: list[str] = []  # generated: regex rules, common terminals
        self.defined: dict[str, int] = {}  # Lark name -> line
        self.used: dict[str, int] = {}  # Lark name -> first line using it
        self.imported: set[str] = set()
        self.ignored: list[list[tuple]] = []
        self.first_rule: str | None = None
        self.regex_count = 0

    def fail(self, line: int, why: str):
        raise ValueError(f"Lark grammar, line {line}: {why}")

    def regex(self, pattern: str, line: int) -> str:
        self.regex_count += 1
        name = f"re-{self.regex_count}"
        try:
            self.extra.append(self.regex_to_ebnf(pattern, name))
        except (RuntimeError, ValueError) as exc:
            self.fail(line, f"the regex /{pattern}/ is not supported ({str(exc).strip().splitlines()[0][-200:]})")
        return name

    def string(self, text: str, line: int) -> str:
        insensitive = text.endswith("i")
        try:
            value = ast.literal_eval(text[:-1] if insensitive else text)
        except (SyntaxError, ValueError):
            self.fail(line, f"cannot read the string {text}")
        if not value:
            return '""'
        if not insensitive:
            return json.dumps(value, ensure_ascii=False)
        parts = [f"[{_class_char(c.lower())}{_class_char(c.upper())}]" if c.lower() != c.upper()
                 else json.dumps(c, ensure_ascii=False) for c in value]
        return "(" + " ".join(parts) + ")"

    def expansion(self, tokens: list[tuple], in_rule: bool) -> str:
        """EBNF for one definition's right-hand side; in a rule with %ignore, each token it uses is preceded by
        the ignored terminals."""
        out: list[str] = []
        closers: list[str] = []
        empty_alt = True  # nothing emitted since the last '|' or '(' (an empty alternative is "")
        i = 0

        def token(text: str, terminal: bool) -> None:
            nonlocal empty_alt
            out.append(f"({_IGNORED} {text})" if terminal and in_rule and self.ignored else text)
            empty_alt = False

        while i < len(tokens):
            kind, text, line = tokens[i]
            if kind == "string":
                if i + 2 < len(tokens) and tokens[i + 1][1] == ".." and tokens[i + 2][0] == "string":
                    token(self.char_range(text, tokens[i + 2][1], line), True)
                    i += 2
                else:
                    token(self.string(text, line), True)
            elif kind == "regex":
                pattern, _, flags = text[1:].rpartition("/")
                if flags:
                    self.fail(line, f"regex flags ({flags}) are not supported")
                token(self.regex(pattern.replace("\\/", "/"), line), True)
            elif kind == "name":
                self.used.setdefault(text, line)
                token(_ebnf_name(text), _is_terminal(text))
            elif text in ("(", "["):
                out.append("(")
                closers.append(")" if text == "(" else ")?")
                empty_alt = True
            elif text in (")", "]"):
                if not closers or closers[-1] != (")" if text == ")" else ")?"):
                    self.fail(line, f"unbalanced {text}")
                if empty_alt:
                    out.append('""')
                out.append(closers.pop())
                empty_alt = False
            elif text == "|":
                if empty_alt:
                    out.append('""')
                out.append("|")
                empty_alt = True
            elif text in ("?", "*", "+"):
                if empty_alt:
                    self.fail(line, f"{text} follows nothing")
                out[-1] += text
            elif text == "~":
                i, repeat = self.repeat(tokens, i, line)
                if empty_alt:
                    self.fail(line, "~ follows nothing")
                out[-1] += repeat
            elif text == "->":  # an alias names a tree node: nothing to match
                if i + 1 >= len(tokens) or tokens[i + 1][0] != "name":
                    self.fail(line, "-> needs a name")
                i += 1
            elif text == "{":
                self.fail(line, "rule templates (name{...}) are not supported")
            else:
                self.fail(line, f"unexpected {text!r}")
            i += 1
        if closers:
            self.fail(tokens[-1][2], "unclosed ( or [")
        if empty_alt:
            out.append('""')
        return " ".join(out)

    def repeat(self, tokens: list[tuple], i: int, line: int) -> tuple[int, str]:
        numbers = tokens[i + 1:i + 4]
        if not numbers or numbers[0][0] != "number":
            self.fail(line, "~ needs a count (x ~ 3 or x ~ 2..5)")
        low = int(numbers[0][1])
        if len(numbers) == 3 and numbers[1][1] == ".." and numbers[2][0] == "number":
            high = int(numbers[2][1])
            if high < low:
                self.fail(line, f"~ {low}..{high}: the range is empty")
            return i + 3, f"{{{low},{high}}}"
        return i + 1, f"{{{low}}}"

    def char_range(self, low: str, high: str, line: int) -> str:
        a, b = (ast.literal_eval(s) for s in (low, high))
        if len(a) != 1 or len(b) != 1 or a > b:
            self.fail(line, f"{low}..{high} must be a range of single characters, low to high")
        return f"[{_class_char(a)}-{_class_char(b)}]"


def _class_char(c: str) -> str:
    if c in "]\\^-":
        return "\\" + c
    return json.dumps(c, ensure_ascii=False)[1:-1] if c.isspace() or not c.isprintable() else c


def _statements(grammar: str) -> list[list[tuple]]:
    """Tokens grouped by statement: a line starts one, unless it starts with '|' (an alternative continued)."""
    statements: list[list[tuple]] = []
    line, pos, line_start = 1, 0, True
    while pos < len(grammar):
        match = _TOKEN.match(grammar, pos)
        if match is None:
            raise ValueError(f"Lark grammar, line {line}: cannot read {grammar[pos:pos + 20]!r}")
        kind, text = match.lastgroup, match.group()
        pos = match.end()
        if kind == "newline":
            line, line_start = line + 1, True
        elif kind not in ("space", "comment"):
            if line_start and (text != "|" or not statements):
                statements.append([])
            statements[-1].append((kind, text, line))
            line_start = False
    return statements


def lark_to_ebnf(grammar: str, regex_to_ebnf) -> str:
    """The EBNF of a Lark grammar. ``regex_to_ebnf(pattern, name)``: EBNF rules defining ``name`` as the regex
    (``grammar_from_text`` passes xgrammar's translation). ValueError naming the line for what cannot be read."""
    tr = _Translator(regex_to_ebnf)
    definitions: list[tuple[str, list[tuple], int]] = []
    for statement in _statements(grammar):
        kind, text, line = statement[0]
        if kind == "directive":
            _directive(tr, text, statement[1:], line)
            continue
        head = statement
        if head[0][1] in ("?", "!"):
            head = head[1:]
        if len(head) < 2 or head[0][0] != "name":
            tr.fail(line, f"expected a definition (name: ...), got {text!r}")
        name, rest = head[0][1], head[1:]
        if rest[0][1] == "{":
            tr.fail(line, "rule templates (name{...}) are not supported")
        if rest[0][1] == "." and len(rest) > 1 and rest[1][0] == "number":  # a terminal's priority
            rest = rest[2:]
        if not rest or rest[0][1] != ":":
            tr.fail(line, f"expected ':' after {name}")
        if name in tr.defined:
            tr.fail(line, f"{name} is defined twice (first on line {tr.defined[name]})")
        tr.defined[name] = line
        if not _is_terminal(name) and tr.first_rule is None:
            tr.first_rule = name
        definitions.append((name, rest[1:], line))
    if tr.first_rule is None:
        raise ValueError("Lark grammar: no rule (a lowercase name: ...) to start from")
    for name, tokens, _ in definitions:
        tr.rules.append(f"{_ebnf_name(name)} ::= {tr.expansion(tokens, not _is_terminal(name))}")
    for name in tr.imported & tr.defined.keys():
        tr.fail(tr.defined[name], f"{name} is both imported and defined")
    for name, line in tr.used.items():
        if name not in tr.defined and name not in tr.imported:
            hint = f" (add %import common.{name})" if name in COMMON else ""
            tr.fail(line, f"{name} is not defined{hint}")
    start = _ebnf_name("start" if "start" in tr.defined else tr.first_rule)
    lines = [f"root ::= {start} {_IGNORED}" if tr.ignored else f"root ::= {start}"]
    if tr.ignored:
        choices = " | ".join(tr.expansion(tokens, False) for tokens in tr.ignored)
        lines.append(f"{_IGNORED} ::= ({choices})*")
    return "\n".join(lines + tr.rules + tr.extra)


def _directive(tr: _Translator, directive: str, args: list[tuple], line: int) -> None:
    if directive == "%ignore":
        if not args:
            tr.fail(line, "%ignore needs a terminal")
        for kind, text, _ in args:
            if kind == "name":
                tr.used.setdefault(text, line)
        tr.ignored.append(args)
        return
    if directive != "%import":
        tr.fail(line, f"{directive} is not supported")
    texts = [t[1] for t in args]
    if texts[:2] != ["common", "."] and texts[:2] != ["common", "("]:
        tr.fail(line, "only %import common.NAME (Lark's common terminals) is supported")
    if texts[1] == ".":  # %import common.NAME [-> ALIAS]
        names = [(texts[2] if len(texts) > 2 else "", texts[4] if texts[3:4] == ["->"] and len(texts) > 4 else None)]
    else:  # %import common (A, B)
        names = [(t, None) for t in texts[2:] if t not in (",", ")")]
    for name, alias in names:
        if name not in COMMON:
            tr.fail(line, f"common.{name} is not one of Lark's common terminals ({', '.join(COMMON)})")
        target = alias or name
        if target not in tr.imported:
            tr.imported.add(target)
            tr.extra.append(tr.regex_to_ebnf(COMMON[name], target))


def grammar_from_text(grammar: str):
    """An xgrammar ``Grammar`` from EBNF, or from Lark (translated first)."""
    import xgrammar as xgr

    if looks_like_lark(grammar):
        grammar = lark_to_ebnf(grammar, regex_rules)
    return xgr.Grammar.from_ebnf(grammar)


def regex_rules(pattern: str, name: str) -> str:
    """xgrammar's EBNF for a regex, its rules renamed from ``root`` / ``root_N`` to ``name`` / ``name-N``."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_regex(pattern))
    return _rename_root(ebnf, name)


def _rename_root(ebnf: str, name: str) -> str:
    """Rename the identifiers root, root_1, ... outside string literals and character classes."""
    out, i = [], 0
    pieces = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\broot(?:_\d+)*\b')
    for match in pieces.finditer(ebnf):
        out.append(ebnf[i:match.start()])
        text = match.group()
        # root_2_1 -> name-2-1: a '-' no Lark name holds, so no clash with the grammar's own names
        out.append(name + text[4:].replace("_", "-") if text.startswith("root") else text)
        i = match.end()
    out.append(ebnf[i:])
    return "".join(out)
