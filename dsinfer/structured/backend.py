"""The xgrammar side: tokenizer info from dsinfer's tokenizer, grammar construction (validation) and compilation.

Building a ``Grammar`` parses the constraint (fast; invalid input raises here, on the caller's thread);
compiling it precomputes token masks for the vocabulary (the slow part, run in the manager's thread pool).
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from dsinfer.structured.lark import grammar_from_text
from dsinfer.structured.schema_patterns import check_schema_patterns
from dsinfer.structured.spec import StructuredSpec
from dsinfer.tokenizer import Tokenizer

# Whitespace runs between JSON tokens are bounded, so a small model cannot stall in an endless run of spaces.
MAX_JSON_WHITESPACE = 8
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """Token strings by id (model vocab size; ids past the tokenizer are empty) and the vocab's encoding."""
    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=meta["add_prefix_space"])


def build_grammar(spec: StructuredSpec) -> xgr.Grammar:
    """The grammar of a spec; ValueError (with xgrammar's reason) when the schema / regex / EBNF is invalid."""
    try:
        return _build(spec)
    except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as exc:
        reason = _LOG_PREFIX.sub("", str(exc).strip()).strip()
        raise ValueError(f"invalid structured_outputs.{_name(spec)}: {reason}") from None


def _name(spec: StructuredSpec) -> str:
    return "json_object" if spec.kind == "json" and spec.value is None else spec.kind


def _build(spec: StructuredSpec) -> xgr.Grammar:
    if spec.kind == "json":
        schema: Any = spec.value
        strict = True
        if schema is None or schema is True:  # any JSON object / any JSON value
            schema, strict = ({"type": "object"} if schema is None else {}), False
        if schema is False:
            raise ValueError("the schema `false` accepts no value")
        check_schema_patterns(schema, xgr.Grammar.from_regex)
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=spec.any_whitespace,
                                            strict_mode=strict, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "grammar":
        return grammar_from_text(spec.value)  # EBNF, or Lark translated to it
    if spec.kind == "choice":
        # EBNF string literals: quotes, backslashes and control characters escaped; anything else as itself, since
        # the grammar reads each \\u escape as one code point and would take a surrogate pair for two (emoji)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value))
    return xgr.Grammar.from_structural_tag(json.dumps(spec.value))


class GrammarCompiler:
    """Compiles grammars for one vocabulary; xgrammar's own cache is off (the manager's bounded cache is used)."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int):
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(grammar)


def compiled_size(compiled: xgr.CompiledGrammar) -> int:
    return int(compiled.memory_size_bytes)
