"""An assistant turn with ``tool_calls`` replayed in a later request renders token-identically to transformers'
``apply_chat_template`` of the same conversation with the text the model wrote for those calls (issue 45: the
ChatML history gained a newline before a first call, so a replayed turn was not the model's own tokens and
missed the prefix cache). Checked with the bundled model's template (which knows no tools: calls become Hermes
text) and with the built-in ChatML (the bundled tokenizer) and DeepSeek-V3 templates (a tokenizer with DeepSeek's
markers as special tokens: without them, text beside a marker merges into other tokens)."""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from dsinfer.protocol.chat_encoding import ChatEncoder
from dsinfer.protocol.chat_formats import CHATML_TEMPLATE, DEEPSEEK_V3_TEMPLATE
from dsinfer.tokenizer import Tokenizer

ARGS = {"city": "Paris", "unit": "celsius"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
TIME = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


def _hermes(name: str, args: dict) -> str:
    """A call as the model writes it after the Hermes tools prompt."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def _deepseek(calls: list[tuple[str, dict]]) -> str:
    inner = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```"
                      "<｜tool▁call▁end｜>" for name, args in calls)
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def _conversation(content: str | None, calls: list[dict]) -> list[dict]:
    return [{"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": calls},
            {"role": "user", "content": "Thanks. And tomorrow?"}]


# (the assistant's text before its calls, the calls, the text the model wrote for them in each format)
CASES = [
    (None, [CALL], _hermes("get_weather", ARGS), _deepseek([("get_weather", ARGS)])),
    ("", [CALL, TIME], _hermes("get_weather", ARGS) + "\n" + _hermes("get_time", {}),
     _deepseek([("get_weather", ARGS), ("get_time", {})])),
    ("Let me look.", [CALL], "Let me look.\n" + _hermes("get_weather", ARGS),
     "Let me look." + _deepseek([("get_weather", ARGS)])),
]
IDS = ["one call", "two calls", "text then a call"]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    from dsinfer.models.loader.gguf import cached_gguf_dir, default_model_path

    return Tokenizer.from_dir(cached_gguf_dir(default_model_path()))


DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"]


@pytest.fixture(scope="module")
def deepseek_like(tmp_path_factory) -> Tokenizer:
    """The tiny byte-level tokenizer with DeepSeek-V3's markers as its special tokens, as DeepSeek's has them."""
    import tokenizers

    from .tiny_tokenizer import write_tiny_tokenizer

    path = write_tiny_tokenizer(tmp_path_factory.mktemp("ds_tok"))
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(DEEPSEEK_SPECIAL)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": DEEPSEEK_SPECIAL[0],
                                                            "eos_token": DEEPSEEK_SPECIAL[1]}))
    return Tokenizer.from_dir(path)


def _reference(tokenizer: Tokenizer, template: str, messages: list[dict]) -> list[int]:
    text = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                 bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")[0][0]
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("content, calls, hermes, deepseek", CASES, ids=IDS)
def test_replayed_calls_render_as_the_model_wrote_them_with_the_bundled_template(smollm2, content, calls, hermes,
                                                                                 deepseek):
    template = smollm2.chat_template
    assert "tool_calls" not in template  # calls and results go in as the Hermes text the model wrote
    encoded = ChatEncoder(smollm2, template).encode(_conversation(content, calls))
    written = [{**m, "content": hermes} if m["role"] == "assistant" else m for m in _conversation(content, calls)]
    assert encoded.token_ids == _reference(smollm2, template, [{k: v for k, v in m.items() if k != "tool_calls"}
                                                               for m in written])


@pytest.mark.parametrize("content, calls, hermes, deepseek", CASES, ids=IDS)
@pytest.mark.parametrize("fmt", ["chatml", "deepseek_v3"])
def test_replayed_calls_are_token_identical_to_transformers_with_the_builtin_templates(smollm2, deepseek_like, fmt,
                                                                                       content, calls, hermes,
                                                                                       deepseek):
    template = {"chatml": CHATML_TEMPLATE, "deepseek_v3": DEEPSEEK_V3_TEMPLATE}[fmt]
    tokenizer = smollm2 if fmt == "chatml" else deepseek_like
    conversation = _conversation(content, calls)
    encoded = ChatEncoder(tokenizer, template).encode(conversation)
    # transformers given the same messages, arguments as objects (as HF templates expect them)
    as_objects = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in conversation]
    assert encoded.token_ids == _reference(tokenizer, template, as_objects)
    # ... and the turn holds what the model wrote for the calls, nothing added
    written = {"chatml": hermes, "deepseek_v3": deepseek}[fmt]
    plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conversation]
    plain[1]["content"] = written
    assert encoded.token_ids == _reference(tokenizer, template, plain)
