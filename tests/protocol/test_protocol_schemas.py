from __future__ import annotations

import json

import pytest

from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from dsinfer.protocol.sampling import build_sampling_params, resolve_max_tokens
from dsinfer.protocol.structured_request import check_grammar_syntax
from dsinfer.server.json_depth import json_depth

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 1.5),
        ("max_tokens", 2.0),
        ("max_tokens", "16"),
        ("max_tokens", True),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 2**63),
        ("n", 10**9),
        ("n", 0),
        ("top_logprobs", 2**31 + 1),  # 21 passes the schema: the engine's max_logprobs is the limit
        ("top_logprobs", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("temperature", -0.1),
        ("seed", 2**64),
        ("logit_bias", {"-5": 1.0}),
        ("logit_bias", {"7": 101}),
        ("stop_token_ids", [-1]),
        ("stop", [""]),
        ("logprobs", "yes"),
    ],
)
def test_out_of_range_or_mistyped_fields_are_rejected(field, value):
    with pytest.raises(ValueError) as err:
        ChatCompletionRequest.model_validate_json(json.dumps({**BASE, field: value}))
    assert field in str(err.value)


def test_nan_temperature_is_rejected():
    body = json.dumps(BASE)[:-1] + ', "temperature": NaN}'
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate_json(body)


def test_valid_request_maps_to_sampling_params():
    req = ChatCompletionRequest.model_validate_json(
        json.dumps({**BASE, "max_tokens": 8, "temperature": 0, "top_p": 0.9, "seed": 3, "n": 2, "stop": "x"})
    )
    params = build_sampling_params(
        {
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "n": req.n,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": req.stop,
        },
        100,
        stream=False,
    )
    assert (params.max_tokens, params.n, params.seed, params.stop) == (8, 2, 3, ["x"])


def test_completion_prompt_takes_a_batch_of_strings_or_token_lists():
    assert CompletionRequest.model_validate_json('{"prompt": [1, 2, 3]}').prompt == [1, 2, 3]
    assert CompletionRequest.model_validate_json('{"prompt": ["a", "b"], "n": 2}').prompt == ["a", "b"]
    assert CompletionRequest.model_validate_json('{"prompt": [[1], [2, 3]]}').prompt == [[1], [2, 3]]
    assert len(CompletionRequest.model_validate({"prompt": ["a"] * 32, "n": 4}).prompt) == 32  # 128 choices
    for body in ('{"prompt": []}', '{"prompt": [[1], []]}', '{"prompt": [[1], [-1]]}', '{"prompt": ["a", 3]}'):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate_json(body)


def test_out_of_vocab_logit_bias_is_a_400():
    with pytest.raises(ProtocolError) as err:
        build_sampling_params({"logit_bias": {500: 1.0}}, vocab_size=400, stream=False)
    assert err.value.status == 400 and "500" in err.value.message


def test_context_length_check():
    assert resolve_max_tokens(None, 10, 32) == 22
    assert resolve_max_tokens(22, 10, 32) == 22
    with pytest.raises(ProtocolError) as err:
        resolve_max_tokens(23, 10, 32)
    assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(b'{"a": [[1]], "s": "[[[[{{{{\\"]]]"}') == 3
    assert json_depth(b'{"a": "\\\\", "b": [[{"c": "\\\\\\"["}]]}') == 4  # \\ ends a string, \\\" does not
    assert json_depth(b"[" * 100000 + b"]" * 100000) == 100000
    assert json_depth(b'"no brackets"') == 0


def test_json_depth_matches_the_parser_and_stays_linear_on_hostile_strings():
    import json
    import random
    import time

    rng = random.Random(3)
    pieces = ['"', "\\", "[", "]", "{", "}", "a", "\\n"]

    def value(depth):
        kind = rng.randrange(4 if depth < 6 else 1)
        if kind == 0:
            return "".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
        if kind == 1:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        if kind == 2:
            return {str(i): value(depth + 1) for i in range(rng.randrange(3))}
        return rng.randrange(100)

    def depth_of(v):
        if isinstance(v, list):
            return 1 + max(map(depth_of, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth_of, v.values()), default=0)
        return 0

    for _ in range(300):
        v = value(0)
        assert json_depth(json.dumps(v).encode()) == depth_of(v)
    hostile = b'{"prompt": "' + b'\\"' * 1_000_000  # 2 MB unterminated string of escaped quotes
    start = time.perf_counter()
    assert json_depth(hostile) == 1
    assert time.perf_counter() - start < 2.0  # linear (the old regex scan was quadratic: hours at this size)


@pytest.mark.parametrize("schema, body, fields", [
    (ChatCompletionRequest, BASE, {"n": 1, "stream": False, "logprobs": False, "parallel_tool_calls": True}),
    (CompletionRequest, {"model": "m", "prompt": "hi"}, {"n": 1, "echo": False, "stream": False}),
    ("anthropic", {"model": "m", "max_tokens": 4, "messages": BASE["messages"]}, {"stream": False}),
])
def test_explicit_null_means_the_default(schema, body, fields):
    """Clients and proxies that serialize unset fields send ``null``; OpenAI and Anthropic take it as the default."""
    if schema == "anthropic":
        from dsinfer.protocol.anthropic_schemas import MessagesRequest as schema
    request = schema.model_validate({**body, **dict.fromkeys(fields)})
    assert {k: getattr(request, k) for k in fields} == fields


def test_null_keeps_its_meaning_where_the_type_takes_it():
    """The completions' ``"max_tokens": null`` asks for the room left, not the default 16; a required field is
    still required."""
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": None}).max_tokens is None
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).max_tokens == 16
    with pytest.raises(ValueError, match="messages"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": None})


def test_validation_messages_name_the_field_plainly():
    from pydantic import ValidationError

    from dsinfer.protocol.errors import describe_validation_errors

    def message(schema, body):
        with pytest.raises(ValidationError) as err:
            schema.model_validate(body)
        return describe_validation_errors(err.value.errors(include_url=False))

    assert message(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "n": 65}) == (
        "prompt: a batch of 2 prompts with n=65 asks for 130 choices; at most 128 (prompts x n) are allowed",
        "prompt")
    assert message(CompletionRequest, {"model": "m", "prompt": ["a"] * 129}) == (
        "prompt: a batch of 129 prompts with n=1 asks for 129 choices; at most 128 (prompts x n) are allowed",
        "prompt")
    assert message(CompletionRequest, {"model": "m", "prompt": [[1], "a"]}) == (
        "prompt: a batch of prompts must be all strings or all lists of token ids", "prompt")
    assert message(ChatCompletionRequest, {"model": "m"}) == ("messages: Field required", "messages")
    assert message(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "a"}],
                                           "temperature": "hot"})[0].endswith("(got 'hot')")  # a scalar: shown


def test_union_field_messages_come_from_the_branch_that_fits_the_value():
    from pydantic import ValidationError

    from dsinfer.protocol.errors import describe_validation_errors

    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "stop": [str(i) for i in range(17)]})
    text, param = describe_validation_errors(err.value.errors(include_url=False))
    assert param == "stop" and "at most 16" in text, text


@pytest.mark.parametrize("constraint", [
    {"json": {"type": "string", "minLength": -1}},
    {"structural_tag": {"type": "structural_tag", "format": {"type": "json_schema",
                                                             "json_schema": {"type": "string", "minLength": -1}}}},
])
def test_grammar_check_compiles_what_parsing_lets_through(constraint):
    """xgrammar parses these; only compiling refuses them (in the engine's step, before the check compiled too)."""
    pytest.importorskip("xgrammar")
    with pytest.raises(ValueError, match="Invalid repetition range"):
        check_grammar_syntax(constraint)


def test_content_parts_are_text_and_a_text_part_needs_its_text():
    from dsinfer.protocol.conversation import openai_chat_messages

    def messages(*parts):
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": list(parts)}]}).messages

    assert openai_chat_messages(messages({"type": "text", "text": "a"}, {"type": "text", "text": "b"}))[0][
        "content"] == "a\nb"
    with pytest.raises(ProtocolError, match="needs its \"text\" field") as err:
        openai_chat_messages(messages({"type": "text", "text": "a"}, {"type": "text"}))
    assert err.value.param == "messages.0.content.1.text"
    with pytest.raises(ProtocolError, match="'image_url' is not supported") as err:
        openai_chat_messages(messages({"type": "image_url", "image_url": {"url": "x"}}))
    assert err.value.param == "messages.0.content.0.type"


def test_completion_top_logprobs_hold_the_chosen_token_besides_the_top_k():
    """OpenAI's legacy API (and vLLM): up to logprobs + 1 entries, the chosen token always among them."""
    from dsinfer.engine.outputs import Logprob
    from dsinfer.protocol.logprobs import completion_logprobs

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(f"<{i}>" for i in ids)

    tok = Tok()
    unlikely = {7: Logprob(-14.0, 40, "<7>"), 1: Logprob(-0.5, 1, "<1>"), 2: Logprob(-1.5, 2, "<2>")}
    likely = {1: Logprob(-0.5, 1, "<1>"), 2: Logprob(-1.5, 2, "<2>")}
    out, _ = completion_logprobs(tok, [7, 1], [unlikely, likely], 1)
    assert out["top_logprobs"] == [{"<7>": -14.0, "<1>": -0.5}, {"<1>": -0.5}]
    out, _ = completion_logprobs(tok, [7, 1], [unlikely, likely], 0)
    assert out["top_logprobs"] == [{"<7>": -14.0}, {"<1>": -0.5}]
