"""Structured outputs through preemption (recompute keeps the matcher in step), prefix hits and chunked prefill."""

from __future__ import annotations

import json

import pytest

from dsinfer import LLM, SamplingParams

from .schemas import SCHEMAS

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


def test_preempted_requests_still_validate():
    llm = LLM(dtype="float32", num_kv_blocks=14, block_size=16, max_num_batched_tokens=64, max_model_len=192)
    schema = SCHEMAS["book"]
    prompt = [{"role": "user", "content": "A book as JSON, with its title, authors and year. " * 3}]
    compact = {"json": schema, "disable_any_whitespace": True}
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=64, structured_outputs=compact) for i in range(6)]
    outputs = llm.chat([prompt] * 6, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.scheduler.num_preemptions > 0
    # a second round hits the prefix cache for the shared prompt
    again = llm.chat([prompt], params[:1], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    jsonschema.validate(json.loads(again.outputs[0].text), schema)
