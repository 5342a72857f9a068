"""Lark grammars in ``structured_outputs.grammar`` (translated to xgrammar's EBNF, as vLLM takes them): the strings
each translated grammar accepts and refuses, the errors for what is not translated, and generation under one."""

from __future__ import annotations

import re

import pytest

from dsinfer import SamplingParams
from dsinfer.structured.lark import looks_like_lark

from .schemas import ARITHMETIC_REGEX

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from dsinfer.structured.lark import grammar_from_text, lark_to_ebnf, regex_rules  # noqa: E402

CALCULATOR = r"""
// Lark's calculator example, trimmed
?start: sum
?sum: product
    | sum "+" product   -> add
    | sum "-" product   -> sub
?product: atom ("*" atom)*
?atom: NUMBER | "-" atom | "(" sum ")" | NAME
NAME: /[a-z_][a-z0-9_]*/
%import common.NUMBER
%import common.WS
%ignore WS
"""

ARITHMETIC_LARK = r"""
start: "Answer: " expr
expr: term (op term)? (op term)?
op: " + " | " - " | " * "
term: num | "(" num " + " num ")"
num: "1".."9" DIGIT?
%import common.DIGIT
"""


def accepts(lark: str, text: str) -> bool:
    return _is_grammar_accept_string(grammar_from_text(lark), text)


def test_lark_is_told_from_ebnf():
    assert looks_like_lark(CALCULATOR) and looks_like_lark("start: \"a\"")
    assert not looks_like_lark('root ::= "a" b\nb ::= "c"')
    assert not looks_like_lark('root ::= "a: b"')


@pytest.mark.parametrize("text, ok", [
    ("1+2", True), ("1 + 2 * x_1", True), ("  (3.5e2 - -y) * 4  ", True), ("\n7\n", True),
    ("1 +", False), ("1 2", False), ("(1", False), ("X", False), ("", False),
])
def test_the_calculator_with_ignored_whitespace(text, ok):
    assert accepts(CALCULATOR, text) is ok


@pytest.mark.parametrize("lark, good, bad", [
    ('start: "a" ["b"] "c"', ["ac", "abc"], ["abbc", "a"]),
    ('start: "x" ~ 3', ["xxx"], ["xx", "xxxx"]),
    ('start: "x" ~ 2..3', ["xx", "xxx"], ["x", "xxxx"]),
    ('start: ("a".."c")+', ["abcab"], ["abd", ""]),
    ('start: "yes"i', ["yes", "YeS", "YES"], ["ye", "yess"]),
    ('start: A B\nA: /[0-9]{2}/\nB: /-?[a-f]+/', ["12ab", "00-f"], ["1ab", "12"]),
    ('start: "a" | \nfoo: "z"', ["a", ""], ["z"]),  # an empty alternative; start is named, not first
    ('first: "f" second\nsecond: "s"', ["fs"], ["s"]),  # no start rule: the first rule
    ('start: root "!"\nroot: "r"', ["r!"], ["r"]),  # a rule named root keeps its meaning
    ('start: WORD ("," WORD)*\n%import common (WORD, WS_INLINE)\n%ignore WS_INLINE', ["a, b ,c"], ["a,,b"]),
    ('start: NUM\n%import common.INT -> NUM', ["42"], ["4.2"]),
    ('start: ESCAPED_STRING\n%import common.ESCAPED_STRING', ['"a\\"b"'], ['"a"b"']),
    ('start: T\nT.2: "t" | "u"', ["t", "u"], ["tu"]),  # a terminal priority is dropped
    ('!start: "a" -> alias\n    | "b"', ["a", "b"], ["ab"]),
    ('start: "\\n" "\\u00e9" "a/b" /c\\/d/', ["\néa/bc/d"], ["\\néa/bc/d"]),
])
def test_each_construct(lark, good, bad):
    for text in good:
        assert accepts(lark, text), (lark, text)
    for text in bad:
        assert not accepts(lark, text), (lark, text)


@pytest.mark.parametrize("lark, match", [
    ("start: pair{a}\n", "line 1: rule templates"),
    ("_sep{x, sep}: x (sep x)*\nstart: \"a\"", "line 1: rule templates"),
    ('start: "a"\n%declare B', "line 2: %declare is not supported"),
    ('start: "a"\n%import python.NAME', "line 2: only %import common"),
    ('start: "a"\n%import common.NOPE', "common.NOPE is not one of"),
    ('start: /a/i', "regex flags"),
    ('start: /a(?=b)/', "regex /a\\(\\?=b\\)/ is not supported"),
    ('start: NUMBER', "line 1: NUMBER is not defined \\(add %import common.NUMBER\\)"),
    ('start: other', "line 1: other is not defined"),
    ('start: "a"\nstart: "b"', "line 2: start is defined twice"),
    ('start: ("a"', "unclosed"),
    ('start: "a"]', "unbalanced"),
    ('start: "a" ~ x', "~ needs a count"),
    ('start: "a" ~ 3..1', "the range is empty"),
    ('start: "ab".."z"', "range of single characters"),
    ('A: "a"\n', "no rule"),
    ('start: "a" @', "cannot read"),
    ('start: WS\nWS: " "\n%import common.WS', "WS is both imported and defined"),
])
def test_what_is_not_translated_is_a_value_error_naming_it(lark, match):
    with pytest.raises(ValueError, match=match):
        lark_to_ebnf(lark, regex_rules)


def test_generated_names_never_meet_the_grammars_own():
    """xgrammar names a regex's parts root_1, root_2 ...: renamed with '-', which no Lark name holds."""
    ebnf = lark_to_ebnf('start: A A_1\nA: /[ab]+c?/\nA_1: "x"', regex_rules)
    assert "A_1 ::= " in ebnf and "re-" not in ebnf.split("A_1 ::=")[1].split("\n")[0]
    assert accepts('start: A A_1\nA: /[ab]+c?/\nA_1: "x"', "abcx")


def test_invalid_lark_through_the_engine_is_a_value_error_naming_the_field(smollm2_llm):
    with pytest.raises(ValueError, match="structured_outputs.grammar.*Lark grammar, line 1: other is not defined"):
        smollm2_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs={"grammar": "start: other"}),
                             use_tqdm=False)


def test_generation_under_a_lark_grammar(smollm2_llm):
    """The arithmetic grammar of the EBNF test, written in Lark: every sample fits its regex."""
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=96, structured_outputs={"grammar": ARITHMETIC_LARK})
              for s in range(4)]
    outputs = smollm2_llm.chat([[{"role": "user", "content": "Write a sum of small numbers."}]] * 4, params,
                               use_tqdm=False)
    for out in outputs:
        assert re.fullmatch(ARITHMETIC_REGEX, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
