"""A request's own chat template (--trust-request-chat-template) is rendered within bounds of time and size
(issue 45's findings: nested loops that ate 16 GB, ``'a' * 10**8`` that never answered, ``range(10**9)`` and
``[0] * 10**7`` that were 500s): each is refused as a template error (a 400), in bounded time, and the render
is stopped."""

from __future__ import annotations

import threading
import time

import pytest

from dsinfer import chat_template
from dsinfer.chat_template import render_template
from dsinfer.protocol.chat_encoding import ChatEncoder
from dsinfer.protocol.errors import ProtocolError

NESTED_OUTPUT = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
NESTED_SILENT = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def small_limits(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_CHARS", 1 << 16)
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 0.5)


@pytest.mark.parametrize("template, reason", [
    (NESTED_OUTPUT, "the rendered prompt would pass the chat template limit of 65536 characters"),
    (NESTED_SILENT, "ran past its time limit of 0.5s"),
    ("{{ 'a' * 10**8 }}", r"a repetition \(1 x 100000000\) would pass"),
    ("{{ [0] * 10**7 }}", "would pass the chat template limit of 1048576 items"),
    ("{{ range(10**9) | list }}", "Range too big"),
    ("{{ 'a' | center(10**9) }}", "a filter's argument 1000000000 would pass"),
    ("{{ 7 ** 1000000 }}", r"7 \*\* 1000000 is too large"),
    ("{% set s = 'a' * 40000 %}{{ s + s }}", "a concatenation would pass"),
])
def test_an_unbounded_template_is_a_template_error_in_bounded_time(small_limits, template, reason):
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"chat template error: .*{reason}"):
        render_template(template)
    assert time.monotonic() - started < 3
    assert not [t for t in threading.enumerate() if t.name == "dsinfer-chat-template"]  # the render was stopped


def test_bounded_templates_still_render(small_limits):
    assert render_template("{{ 'ab' * 3 }} {{ 2 ** 10 }} {{ [1] * 2 }} {{ 'x' | center(5) }}") == \
        "ababab 1024 [1, 1]   x  "
    assert render_template("{% for m in messages %}{{ m }};{% endfor %}", messages=["a", "b"]) == "a;b;"


def test_a_request_template_past_the_bounds_is_a_400(small_limits, tokenizer):
    encoder = ChatEncoder(tokenizer, tokenizer.chat_template)
    for template in (NESTED_OUTPUT, NESTED_SILENT, "{{ range(10**9) | list }}"):
        started = time.monotonic()
        with pytest.raises(ProtocolError) as refused:
            encoder.encode([{"role": "user", "content": "hi"}], template=template)
        assert refused.value.status == 400 and time.monotonic() - started < 3, refused.value.message
