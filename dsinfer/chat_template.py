"""The one sandboxed jinja2 environment chat templates are rendered in, configured as HF transformers configures
its own: ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, the ``tojson`` filter
and the ``raise_exception`` / ``strftime_now`` globals.

Both renderers build theirs here: the tokenizer's plain ``render_template`` and the protocol's special-token-safe
chat encoding, which passes its own ``tojson`` (restoring markers JSON-escaped) and ``raise_exception`` (a 400).
jinja2 is imported inside the functions: ``import dsinfer`` does not load it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter (same keywords, same positional order)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` as transformers' template environment has it: the tag marks the
    assistant's tokens (for training masks) and renders its body unchanged, which is all inference needs."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def sandboxed_environment(
    *, tojson: Callable[..., str] = tojson, raise_exception: Callable[[str], None] = _raise_exception,
):
    """A new ``ImmutableSandboxedEnvironment`` for chat templates. ``tojson`` and ``raise_exception`` replace the
    plain filter and the ``ValueError``-raising global (the protocol's encoder passes its own)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_tag()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=1)
def _default_env():
    return sandboxed_environment()


@lru_cache(maxsize=32)
def _compile(template: str):
    return _default_env().from_string(template)


def render_template(template: str, **context: Any) -> str:
    """``template`` rendered with ``context``; a template that fails to compile or render is a ``ValueError``."""
    from jinja2 import TemplateError

    try:
        return _compile(template).render(**context)
    except TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from None
