"""Protocol gaps real clients hit (issue 45): /openapi.json, /tokenizer_info, /tokenize's size cap, echo with
``max_tokens: 0`` (lm-eval's loglikelihood), a grammar that can never finish refused at compile time, patterns the
backend cannot enforce (lookaheads, untyped) refused, and a bad structural tag's 400 naming the field."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from dsinfer.structured.finite import unproductive_rules


def test_openapi_json_is_served_without_a_key(server):
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize", "/tokenizer_info"} <= set(paths)


def test_tokenizer_info_gives_the_tokenizer_config_and_chat_template(server):
    r = httpx.get(f"{server.url}/tokenizer_info", headers=server.headers(), timeout=30)
    assert r.status_code == 200
    info = r.json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert "<|im_start|>" in info["chat_template"] and isinstance(info["tokenizer_class"], str)
    assert httpx.get(f"{server.url}/tokenizer_info", timeout=30).status_code == 401  # behind the API key


def test_tokenize_refuses_a_text_too_long_for_the_context_before_tokenizing_it(server):
    started = time.monotonic()
    r = server.post("/tokenize", json={"prompt": "ab " * 2_000_000})  # 6 MB: far past any 512-token text
    assert r.status_code == 400 and time.monotonic() - started < 3
    assert r.json()["error"]["param"] == "prompt"
    assert "too long for the model's context of 512 tokens" in r.json()["error"]["message"]
    over = server.post("/tokenize", json={"prompt": "hello " * 600})  # short text, more tokens than the context
    assert over.status_code == 400 and "more than the model's context of 512" in over.json()["error"]["message"]
    fits = server.post("/tokenize", json={"prompt": "hello " * 100})
    assert fits.status_code == 200 and 100 <= fits.json()["count"] <= 102


def test_a_completion_prompt_too_long_to_fit_is_refused_before_tokenizing(server):
    r = server.post("/v1/completions", json={"prompt": "ab " * 2_000_000, "max_tokens": 1})
    assert r.status_code == 400 and "too long for the model's context" in r.json()["error"]["message"]


def test_echo_with_max_tokens_0_returns_the_prompt_scored(server):
    prompt = "The capital of France is Paris"
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    num_prompt = server.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == num_prompt
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == prompt and len(logprobs["token_logprobs"]) == num_prompt
    assert logprobs["token_logprobs"][0] is None and all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    plain = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == prompt and plain["choices"][0]["logprobs"] is None


def test_echo_with_max_tokens_0_streams_the_prompt_once(server):
    body = {"prompt": "Hello there", "max_tokens": 0, "echo": True, "stream": True,
            "stream_options": {"include_usage": True}}
    r = server.post("/v1/completions", json=body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "Hello there" and events[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_0_without_echo_is_a_400(server):
    r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= "a" root', "root ::= x\nx ::= x \"b\""])
def test_a_grammar_that_can_never_finish_is_a_400(server, grammar):
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                  "structured_outputs": {"grammar": grammar}})
    assert r.status_code == 400, r.text
    assert "can never finish" in r.json()["error"]["message"]


def test_finishing_grammars_are_productive():
    import json

    import xgrammar as xgr

    assert unproductive_rules(str(xgr.Grammar.from_ebnf('root ::= "a" root | "b"'))) == []
    assert unproductive_rules(str(xgr.Grammar.from_ebnf('root ::= "a" y?\ny ::= y'))) == ["y"]  # optional: fine
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}}}}
    assert unproductive_rules(str(xgr.Grammar.from_json_schema(json.dumps(schema)))) == []
    assert unproductive_rules(str(xgr.Grammar.builtin_json_grammar())) == []


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("structured, where, reason", [
    ({"regex": "(?=a)b"}, "invalid regex constraint", "Lookahead is not supported"),
    ({"json": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}},
     "schema.properties.x.pattern '(?=a)b' cannot be enforced", "Lookahead is not supported"),
    ({"json": {"type": "object", "properties": {"x": {"type": "string", "pattern": r"(a)\1"}}}},
     "schema.properties.x.pattern", "Backreference is not supported"),
    ({"json": {"type": "object", "properties": {"x": {"pattern": "[unclosed"}}}},
     'schema.properties.x.pattern needs "type": "string"', "ignores the pattern"),
    ({"json": {"$defs": {"d": {"type": "string", "pattern": "a(?!b)"}}, "$ref": "#/$defs/d"}},
     "schema.$defs.d.pattern", "Lookahead"),
])
def test_a_pattern_the_backend_cannot_enforce_is_a_400(server, structured, where, reason):
    r = server.post("/v1/chat/completions", json={**CHAT, "structured_outputs": structured})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert where in error["message"] and reason in error["message"] and error["param"] == "structured_outputs"


def test_an_enforceable_pattern_is_enforced(server):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]{3}-[a-z]{2}$"}},
              "required": ["code"], "additionalProperties": False}
    r = server.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", json.loads(r.json()["choices"][0]["message"]["content"])["code"])


@pytest.mark.parametrize("tag, param", [("{bad json", "structured_outputs.structural_tag"),
                                        ({"type": "nope"}, "structured_outputs")])
def test_a_bad_structural_tag_is_a_400_naming_the_field(server, tag, param):
    r = server.post("/v1/chat/completions", json={**CHAT, "structured_outputs": {"structural_tag": tag}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "structural_tag" in error["message"], error
