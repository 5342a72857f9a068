"""Schema fuzzing (issue 45): schemathesis draws requests from ``/openapi.json`` for the OpenAI and Anthropic
routes, bodies that fit the schema (positive) and bodies that break it (negative), and sends them to the live
server: no answer may be a 5xx, and the server stays healthy. The example budget is fixed (``MAX_EXAMPLES`` per
route and mode; ``SCHEMATHESIS_MAX_EXAMPLES`` raises it for a long run outside CI, docs/reliability.md).

Generation length is capped (a drawn ``max_tokens`` of 10,000 would only spend CPU) and positive bodies name
the served model (else nearly all are 404s that test nothing); everything else is as drawn."""

from __future__ import annotations

import collections
import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from .weather_tools import MODEL  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "12"))
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
          "/tokenize", "/detokenize"]
LENGTH_FIELDS = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                 "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}
MAX_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def schema(server):
    raw = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(raw)


@pytest.fixture(scope="module")
def statuses() -> collections.Counter:
    return collections.Counter()


def _bounded(case, path: str, mode: GenerationMode) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
        if isinstance(body.get(field), int) and body[field] > MAX_NEW_TOKENS:
            body[field] = MAX_NEW_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if mode == GenerationMode.POSITIVE:
        body["model"] = MODEL
        if path in LENGTH_FIELDS:
            body.setdefault(LENGTH_FIELDS[path], MAX_NEW_TOKENS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
@pytest.mark.parametrize("path", ROUTES)
def test_no_generated_request_gets_a_5xx(server, schema, statuses, path, mode):
    operation = schema[path]["POST"]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def run(case):
        _bounded(case, path, mode)
        response = case.call(base_url=server.url, headers=server.headers(), timeout=60)
        statuses[(path, mode.value, response.status_code)] += 1
        case.validate_response(response, checks=[not_a_server_error])

    run()
    assert server.alive()


def test_the_fuzzing_reached_past_validation(statuses):
    """Some positive bodies are served (a 200), so the fuzzing exercised generation, not only the validator (most
    fit the schema yet break a rule it cannot state, as a max_tokens past the context: 400s)."""
    positive = {k: v for k, v in statuses.items() if k[1] == "positive"}
    if not positive:
        pytest.skip("run with the fuzzing tests")
    served = sum(v for (_, _, status), v in positive.items() if status == 200)
    by_status = collections.Counter()
    for (_, _, status), count in statuses.items():
        by_status[status] += count
    print(f"\nschemathesis: {sum(statuses.values())} requests, by status {dict(sorted(by_status.items()))}")
    assert served >= 10, sorted(statuses.items())
    assert all(status < 500 for (_, _, status) in statuses)
