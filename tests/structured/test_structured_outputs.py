"""Structured outputs on the bundled SmolLM2 at temperature 0.7: every output parses and validates."""

from __future__ import annotations

import json
import re

import pytest

from dsinfer import SamplingParams, StructuredOutputsParams
from dsinfer.engine.sampling_params import RequestOutputKind

from .schemas import ARITHMETIC_EBNF, ARITHMETIC_REGEX, REGEXES, SCHEMAS

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MAX_TOKENS = 96


def _chat(llm, prompts: list[str], params: list[SamplingParams] | SamplingParams):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def test_json_schemas_all_outputs_validate(smollm2_llm):
    names = list(SCHEMAS)
    assert len(names) >= 20
    prompts = [f"Give an example {n.replace('_', ' ')} as JSON." for n in names]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMAS[n]})
              for i, n in enumerate(names)]
    outputs = _chat(smollm2_llm, prompts, params)
    failures = []
    for name, out in zip(names, outputs):
        text = out.outputs[0].text
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, text, out.outputs[0].finish_reason, str(exc)[:200]))
    assert not failures, failures
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_regexes_fullmatch(smollm2_llm):
    names = list(REGEXES)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_TOKENS, structured_outputs={"regex": REGEXES[n]})
              for i, n in enumerate(names)]
    outputs = _chat(smollm2_llm, [f"Write a {n.replace('_', ' ')}." for n in names], params)
    for name, out in zip(names, outputs):
        assert re.fullmatch(REGEXES[name], out.outputs[0].text), (name, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"


def test_ebnf_grammar_and_choice(smollm2_llm):
    ebnf = {"grammar": ARITHMETIC_EBNF}
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=MAX_TOKENS, structured_outputs=ebnf) for s in range(4)]
    params.append(SamplingParams(temperature=0.7, seed=9, max_tokens=8,
                                 structured_outputs={"choice": ["positive", "negative", "neutral"]}))
    outputs = _chat(smollm2_llm, ["Write a sum of small numbers."] * 4 + ["Sentiment of 'I love it'?"], params)
    for out in outputs[:4]:
        assert re.fullmatch(ARITHMETIC_REGEX, out.outputs[0].text), out.outputs[0].text
    assert outputs[4].outputs[0].text in ("positive", "negative", "neutral")


def test_vllms_params_class_is_taken(smollm2_llm):
    """vLLM scripts pass ``StructuredOutputsParams(...)``: the same constraint as the dict, checked as it is made."""
    made = StructuredOutputsParams(regex=r"[0-9]{3}", disable_any_whitespace=True)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=8, structured_outputs=made)
    assert params.structured_outputs == {"regex": "[0-9]{3}", "disable_any_whitespace": True}
    (out,) = _chat(smollm2_llm, ["A number?"], [params])
    assert re.fullmatch(r"[0-9]{3}", out.outputs[0].text), out.outputs[0].text
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_choices_outside_the_basic_plane_come_out_whole(smollm2_llm):
    """Emoji in a choice (a surrogate pair in JSON's ASCII escapes) are generated as themselves, not as the two
    halves' invalid bytes; quotes, backslashes and newlines in a choice survive too."""
    choices = ["a😀b", "🚀 \"go\"\\\n"]
    for pick in range(2):
        params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"choice": [choices[pick]]})
        out = smollm2_llm.generate(["Pick:"], params, use_tqdm=False)[0].outputs[0]
        assert out.text == choices[pick] and out.finish_reason == "stop", out.text


def test_json_object_and_n_samples(smollm2_llm):
    params = SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=MAX_TOKENS,
                            structured_outputs={"json": SCHEMAS["person"]})
    out = _chat(smollm2_llm, ["Describe a person as JSON."], params)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMAS["person"])
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json_object": True})
    obj = json.loads(_chat(smollm2_llm, ["Return a JSON object with one key 'ok' set to true."], greedy)[0]
                     .outputs[0].text)
    assert isinstance(obj, dict)


def test_streaming_deltas_concatenate_to_valid_json(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=MAX_TOKENS, output_kind=RequestOutputKind.DELTA,
                            structured_outputs={"json": SCHEMAS["book"]})
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "A book as JSON."}])
    engine.add_request("stream-0", {"prompt": prompt, "prompt_token_ids": engine.tokenizer.encode(prompt)}, params)
    text, deltas = "", 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            deltas += 1
    assert deltas > 2
    jsonschema.validate(json.loads(text), SCHEMAS["book"])


@pytest.mark.parametrize("bad", [
    {"regex": "(["}, {"json": {"type": "foo"}}, {"grammar": "root ::= undefined_rule"},
    {"json": "{not json"}, {"choice": []}, {"json": SCHEMAS["person"], "regex": "a"}, {"jsonn": {}},
])
def test_invalid_constraint_rejected_and_engine_keeps_serving(smollm2_llm, bad):
    with pytest.raises(ValueError, match="structured_outputs"):
        smollm2_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    ok = smollm2_llm.generate(["Pick one:"], SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]}),
                              use_tqdm=False)
    assert ok[0].outputs[0].text in ("a", "b")


def test_unconstrained_companions_are_unaffected(smollm2_llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = _chat(smollm2_llm, ["Say hello."], plain)[0].outputs[0].token_ids
    mixed = _chat(smollm2_llm, ["Say hello.", "Pick:"],
                  [plain, SamplingParams(max_tokens=4, structured_outputs={"choice": ["x", "y"]})])
    assert mixed[0].outputs[0].token_ids == alone


def test_a_grammar_failing_to_compile_between_checks_aborts_only_its_request(smollm2_llm, monkeypatch):
    """The compile thread can fail after the step's check for failed grammars and before the scheduler picks the
    request; it must wait (and be aborted on the next step), not reach the bitmask and kill the engine."""
    import threading

    from dsinfer.structured.manager import StructuredOutputManager

    engine = smollm2_llm.engine
    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_failing_compile(self, key, grammar):
        release.wait(30)
        raise RuntimeError("compile failed late")

    check = type(engine)._fail_uncompilable

    def check_then_fail(self):
        check(self)
        if not release.is_set():  # the grammar fails right after this step's check
            release.set()
            for request in list(self.scheduler.waiting):
                if request.grammar is not None:
                    while not request.grammar.ready:
                        threading.Event().wait(0.01)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_failing_compile)
    monkeypatch.setattr(type(engine), "_fail_uncompilable", check_then_fail)
    late = SamplingParams(max_tokens=4, structured_outputs={"regex": "late[0-9]+"})
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    outs = smollm2_llm.generate(["x", "Say hello."], [late, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[1].outputs[0].token_ids) == 6
    monkeypatch.setattr(StructuredOutputManager, "_compile", compile_grammar)
    ok = smollm2_llm.generate(["Pick one:"], SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]}),
                              use_tqdm=False)
    assert ok[0].outputs[0].text in ("a", "b")
