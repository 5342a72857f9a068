"""The one sandboxed jinja2 environment chat templates are rendered in, configured as HF transformers configures
its own: ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, the ``tojson`` filter
and the ``raise_exception`` / ``strftime_now`` globals.

Both renderers build theirs here: the tokenizer's plain ``render_template`` and the protocol's special-token-safe
chat encoding, which passes its own ``tojson`` (restoring markers JSON-escaped) and ``raise_exception`` (a 400).
jinja2 is imported inside the functions: ``import dsinfer`` does not load it.

Rendering is bounded, as a request may bring its own template (``--trust-request-chat-template``): the sandbox
refuses a ``*``, ``+`` or ``**`` whose result would pass ``MAX_RENDER_CHARS`` characters (``MAX_RENDER_ITEMS``
items, ``MAX_POW_BITS`` bits) and a filter given an integer above that size (``center``, ``indent``...), ``range`` stays
jinja's (at most 100,000 items); ``render_bounded`` stops a render whose output passes ``MAX_RENDER_CHARS`` or
that runs past ``RENDER_TIMEOUT_S`` (loops without output included: the rendering thread gets an exception
raised in it). Each of these is a ``jinja2.sandbox.SecurityError`` (a ``TemplateError``: a 400 on the server).
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any

MAX_RENDER_CHARS = 16 << 20  # a rendering (or a string or list made while rendering) at most this long
MAX_RENDER_ITEMS = 1 << 20  # a list or tuple made while rendering at most this long
MAX_POW_BITS = 1 << 16  # an integer ``**`` result at most this many bits
RENDER_TIMEOUT_S = 10.0  # a rendering stopped after this many seconds


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

    env = _bounded_sandbox(ImmutableSandboxedEnvironment)(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=[loopcontrols, _generation_tag()])
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _too_big(what: str, limit: int | None = None, unit: str = "characters") -> Exception:
    from jinja2.sandbox import SecurityError

    limit = MAX_RENDER_CHARS if limit is None else limit
    return SecurityError(f"{what} would pass the chat template limit of {limit} {unit}")


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


def _check_size(value: Any, size: int, what: str) -> None:
    if isinstance(value, str) and size > MAX_RENDER_CHARS:
        raise _too_big(what)
    if isinstance(value, list | tuple) and size > MAX_RENDER_ITEMS:
        raise _too_big(what, MAX_RENDER_ITEMS, "items")


@lru_cache(maxsize=1)
def _bounded_sandbox(base: type) -> type:
    """``base`` (a jinja2 sandbox) whose ``*``, ``+`` and ``**`` refuse results past the limits."""

    class BoundedSandbox(base):
        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, count in ((left, right), (right, left)):
                    if _size(seq) is not None and isinstance(count, int):
                        _check_size(seq, _size(seq) * count, f"a repetition ({_size(seq)} x {count})")
            elif operator == "+" and _size(left) is not None and _size(right) is not None:
                _check_size(left, _size(left) + _size(right), "a concatenation")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1 and max(abs(left).bit_length() - 1, 1) * right > MAX_POW_BITS:
                    from jinja2.sandbox import SecurityError

                    raise SecurityError(f"{left} ** {right} is too large for a chat template")
            return super().call_binop(context, operator, left, right)

    return BoundedSandbox


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that refuses an integer argument above ``MAX_RENDER_CHARS`` (a width, a count)."""

    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for arg in (*args[1:], *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool) and arg > MAX_RENDER_CHARS:
                raise _too_big(f"a filter's argument {arg}")
        return f(*args, **kwargs)

    return bounded


class _RenderTimeout(Exception):  # noqa: N818 - raised inside the rendering thread only
    pass


def render_bounded(template: Any, context: dict[str, Any], timeout_s: float | None = None) -> str:
    """``template.render(**context)`` stopped, as a ``SecurityError``, once its output passes ``MAX_RENDER_CHARS``
    or it has run ``timeout_s`` (default ``RENDER_TIMEOUT_S``) seconds. It renders in a thread of its own: past the
    deadline an exception is raised in that thread (``PyThreadState_SetAsyncExc``, taken at the next bytecode), so
    that a loop producing nothing stops too; a lock keeps it from landing once the render has finished."""
    from jinja2.sandbox import SecurityError

    timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
    result: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            parts, size = [], 0
            for part in template.generate(**context):
                size += len(part)
                if size > MAX_RENDER_CHARS:
                    raise _too_big("the rendered prompt")
                parts.append(part)
            value: Any = "".join(parts)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            value = exc
        with lock:
            result["value"] = value

    thread = threading.Thread(target=run, name="dsinfer-chat-template", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        if "value" not in result:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(_RenderTimeout))
    thread.join()
    value = result["value"]
    if isinstance(value, _RenderTimeout):
        raise SecurityError(f"the chat template ran past its time limit of {timeout_s:g}s")
    if isinstance(value, BaseException):
        raise value
    return value


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
        return render_bounded(_compile(template), context)
    except (TemplateError, OverflowError) as exc:  # OverflowError: the sandbox's range bound
        raise ValueError(f"chat template error: {exc}") from None
