"""Structured outputs: JSON schema, JSON object, regex, EBNF (or Lark) grammar and choice constraints via xgrammar.

``spec.parse_structured_outputs`` checks the shape of ``SamplingParams.structured_outputs`` without xgrammar;
``StructuredOutputManager`` (imported lazily by the engine, and only when a request asks for structured output)
builds grammars, compiles them in a thread pool into a byte-bounded cache, keeps one matcher per request and
fills the token bitmask that ``ops.apply_token_bitmask`` applies to the logits before sampling.
``import dsinfer`` never imports xgrammar.
"""

from dsinfer.structured.spec import StructuredOutputsParams, StructuredSpec, parse_structured_outputs

__all__ = ["StructuredOutputsParams", "StructuredSpec", "parse_structured_outputs"]
