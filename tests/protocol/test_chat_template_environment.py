"""Both chat-template renderers (``Tokenizer.apply_chat_template`` and the protocol's ``ChatEncoder``) use the one
sandboxed environment that ``dsinfer.chat_template`` builds."""

from __future__ import annotations

import pytest

from dsinfer import chat_template
from dsinfer.protocol import chat_encoding
from dsinfer.protocol.chat_encoding import ChatEncoder

GENERATION_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}</{{ m['role'] }}>{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_generation_tag_renders_its_body_through_the_tokenizer(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, chat_template=GENERATION_TEMPLATE)
    assert text == "<user>Hi</user><assistant>Hello</assistant>"


def test_generation_tag_renders_the_same_through_the_protocol_encoder(tokenizer):
    text, _ = ChatEncoder(tokenizer, GENERATION_TEMPLATE).render(MESSAGES, plain=True)
    assert text == "<user>Hi</user><assistant>Hello</assistant>"


def test_both_renderers_use_the_one_environment_builder(monkeypatch):
    built = []
    real = chat_template.sandboxed_environment
    monkeypatch.setattr(chat_template, "sandboxed_environment", lambda **kw: built.append(kw) or real(**kw))
    monkeypatch.setattr(chat_encoding, "sandboxed_environment", chat_template.sandboxed_environment)
    for cached in (chat_template._default_env, chat_template._compile, chat_encoding._env, chat_encoding._compile):
        cached.cache_clear()
    try:
        chat_template.render_template("{{ 1 }}")
        chat_encoding._compile("{{ 2 }}")
        assert len(built) == 2
        plain, protocol = chat_template._default_env(), chat_encoding._env()
        assert {type(e) for e in plain.extensions.values()} == {type(e) for e in protocol.extensions.values()}
        assert set(plain.globals) == set(protocol.globals) and set(plain.filters) == set(protocol.filters)
    finally:
        for cached in (chat_template._default_env, chat_template._compile, chat_encoding._env, chat_encoding._compile):
            cached.cache_clear()


@pytest.mark.parametrize("args, expected", [("", '{"a": [1, 2]}'), ("indent=1", '{\n "a": [\n  1,\n  2\n ]\n}'),
                                            ("separators=(',', ':')", '{"a":[1,2]}')])
def test_tojson_takes_transformers_keywords(args, expected):
    assert chat_template.render_template("{{ x | tojson(" + args + ") }}", x={"a": [1, 2]}) == expected


def test_raise_exception_in_a_plain_render_is_a_value_error():
    with pytest.raises(ValueError, match="roles must alternate"):
        chat_template.render_template("{{ raise_exception('roles must alternate') }}")
