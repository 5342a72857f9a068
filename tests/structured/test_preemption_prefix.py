"""Structured outputs through preemption (recompute keeps the matcher in step), prefix hits and chunked prefill."""

from __future__ import annotations

import json

import pytest

from dsinfer import LLM, SamplingParams

from .schemas import SCHEMAS

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


def test_preempted_requests_still_validate():
    llm = LLM(dtype="float32", num_kv_blocks=24, block_size=16, max_num_batched_tokens=64, max_model_len=256)
    schema = SCHEMAS["order_items"]
    prompt = [{"role": "user", "content": "An order with a few items, as JSON. " * 3}]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=80, structured_outputs={"json": schema})
              for i in range(6)]
    outputs = llm.chat([prompt] * 6, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outputs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    # a second round hits the prefix cache for the shared prompt
    again = llm.chat([prompt], params[:1], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    jsonschema.validate(json.loads(again.outputs[0].text), schema)
