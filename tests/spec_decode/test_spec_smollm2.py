"""The n-gram drafter on the bundled SmolLM2 where text matters: a passage copied (greedy, identical, most drafts
kept), a stop string falling inside an accepted run, and structured outputs, whose drafts are checked against the
grammar without advancing it (a forbidden draft ends the verified prefix) on a prompt whose text invites
continuations the grammar forbids."""

from __future__ import annotations

import json

import pytest

from dsinfer import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PASSAGE = ("The old lighthouse stood on the northern cliff for more than a century. Every night its keeper "
           "climbed the spiral stairs, trimmed the wick, and watched the beam sweep across the dark water.")


@pytest.fixture(scope="module")
def spec_smollm2():
    return LLM(dtype="float32", speculative_config=SPEC)


def chat(llm, text, params):
    return llm.chat([[{"role": "user", "content": text}]], params, use_tqdm=False)[0].outputs[0]


def stats(llm):
    return llm.engine.get_stats()["spec_decode"]


def test_a_copied_passage_is_identical_and_mostly_drafted(smollm2_llm, spec_smollm2):
    text = "Repeat the following passage exactly:\n\n" + PASSAGE
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want, got = chat(smollm2_llm, text, params), chat(spec_smollm2, text, params)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert stats(spec_smollm2)["mean_acceptance_length"] > 2.5


def test_a_stop_string_inside_an_accepted_run_ends_it(smollm2_llm, spec_smollm2):
    text = "Repeat the following passage exactly:\n\n" + PASSAGE
    params = SamplingParams(max_tokens=32, temperature=0.0, stop=["northern"])
    want, got = chat(smollm2_llm, text, params), chat(spec_smollm2, text, params)
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
           (want.text, want.token_ids, "stop", "northern")


def test_grammar_requests_verify_only_drafts_their_grammar_allows(smollm2_llm, spec_smollm2):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
              "required": ["names"], "additionalProperties": False}
    text = ("The guests were Alice, Bob, Carol, Alice, Bob, Carol, Alice, Bob. List the guests' names as JSON, "
            "Alice, Bob, Carol, Alice, Bob, Carol")
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs={"json": schema, "disable_any_whitespace": True})
    before = dict(stats(spec_smollm2))
    want, got = chat(smollm2_llm, text, params), chat(spec_smollm2, text, params)
    assert got.token_ids == want.token_ids
    assert len(json.loads(got.text)["names"]) <= 4 and got.finish_reason == "stop"
    after = stats(spec_smollm2)
    proposed = after["num_proposed_tokens"] - before["num_proposed_tokens"]
    verified = after["num_draft_tokens"] - before["num_draft_tokens"]
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]  # grammar requests get drafts
    assert verified < proposed  # and the ones their grammar forbids were cut before verification
