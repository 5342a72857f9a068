"""/v1/completions with a batch of prompts (a list of strings or of token-id lists) through the openai SDK: n choices
per prompt, prompt k's choice i at index k * n + i, usage over every prompt; and the Batch that runs them."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import httpx
import pytest

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.protocol.errors import ProtocolError
from dsinfer.server.generation import Batch, ClientDisconnected, Generation
from dsinfer.server.metrics import ServerMetrics

from .live_server import MAX_MODEL_LEN

PROMPTS = ["The capital of France is", "My favourite fruit is the"]
GREEDY = dict(max_tokens=5, temperature=0)


@pytest.fixture(scope="module")
def singles(client, model) -> list:
    """Each prompt of PROMPTS alone (greedy, with logprobs): what the batch's choices must equal."""
    return [client.completions.create(model=model, prompt=p, logprobs=2, **GREEDY) for p in PROMPTS]


def _token_lists(server) -> list[list[int]]:
    return [server.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]


@pytest.mark.parametrize("as_tokens", [False, True], ids=["strings", "token-lists"])
def test_batch_choices_follow_the_prompts_and_equal_single_requests(client, model, server, singles, as_tokens):
    prompt = _token_lists(server) if as_tokens else PROMPTS
    r = client.completions.create(model=model, prompt=prompt, n=2, logprobs=2, **GREEDY)
    assert r.id.startswith("cmpl-") and not re.search(r"-\d+$", r.id)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        single = singles[c.index // 2].choices[0]
        assert (c.text, c.finish_reason) == (single.text, single.finish_reason)
        assert c.logprobs.tokens == single.logprobs.tokens and c.logprobs.text_offset == single.logprobs.text_offset
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_batch_echo_prefixes_each_choice_with_its_own_prompt(client, model, singles):
    r = client.completions.create(model=model, prompt=PROMPTS, echo=True, logprobs=1, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    for c, prompt, single in zip(r.choices, PROMPTS, singles):
        assert c.text == prompt + single.choices[0].text
        assert "".join(c.logprobs.tokens) == c.text and c.logprobs.token_logprobs[0] is None
        assert c.logprobs.text_offset[0] == 0


def test_batch_of_one_is_a_single_prompt(client, model, singles):
    r = client.completions.create(model=model, prompt=PROMPTS[:1], **GREEDY)
    assert [c.text for c in r.choices] == [singles[0].choices[0].text]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens


@pytest.mark.parametrize("echo", [False, True])
def test_batch_stream_interleaves_the_choices_and_ends_each_once(client, model, echo):
    body = dict(model=model, prompt=PROMPTS, n=2, logprobs=1, echo=echo, **GREEDY)
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    texts, ends, offsets = [""] * 4, [0] * 4, [[] for _ in range(4)]
    for chunk in chunks:
        for choice in chunk.choices:
            assert not ends[choice.index], f"choice {choice.index} has a chunk after its finish_reason"
            texts[choice.index] += choice.text
            offsets[choice.index] += choice.logprobs.text_offset
            ends[choice.index] += choice.finish_reason is not None
    assert len({chunk.id for chunk in chunks}) == 1 and not re.search(r"-\d+$", chunks[0].id)  # the answer's id
    assert texts == [c.text for c in whole.choices] and ends == [1] * 4
    assert offsets == [c.logprobs.text_offset for c in whole.choices]
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert not chunks[-1].choices
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_batch_continuous_usage_counts_every_prompt(client, model):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=model, prompt=PROMPTS, stream=True, stream_options=options,
                                            **GREEDY))
    prompt_tokens = client.completions.create(model=model, prompt=PROMPTS, max_tokens=1).usage.prompt_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {prompt_tokens}
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] > 0


def test_batch_shares_a_structured_output_constraint(client, model):
    r = client.completions.create(model=model, prompt=PROMPTS, n=2, max_tokens=5, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and all(c.text in ("yes", "no") for c in r.choices)


def _counters(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    names = ("dsinfer_e2e_request_latency_seconds_count", "dsinfer_prompt_tokens_total",
             "dsinfer_generation_tokens_total")
    return {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for name in names}


@pytest.mark.parametrize("prompt, max_tokens, param, match", [
    (["Hello", ""], 4, "prompt", "prompt 1 of the batch: the prompt is empty"),
    ([[1, 2], [3, 1 << 30]], 4, "prompt", "prompt 1 of the batch: prompt token id 1073741824 is outside"),
    (["Hi", "word " * (MAX_MODEL_LEN - 8)], 16, "max_tokens", "prompt 1 of the batch: .*maximum context length"),
    (["Hi", "word " * MAX_MODEL_LEN], None, "prompt", "prompt 1 of the batch: .*maximum context length"),
    (["Hi"] * 43, 4, "prompt", r"a batch of 43 prompts with n=3 asks for 129 choices; at most 128"),
    (["Hi", [1, 2]], 4, "prompt", "all strings or all lists of token ids"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_prompt_in_the_batch_is_a_400_and_nothing_runs(server, prompt, max_tokens, param, match, stream):
    before = _counters(server)
    n = 3 if len(prompt) == 43 else 1
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "n": n, "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), error
    assert _counters(server) == before  # no prompt of the batch was started


def test_prompts_x_n_at_the_cap_is_served(client, model):
    r = client.completions.create(model=model, prompt=["Hi"] * 64, n=2, max_tokens=1, temperature=0)
    assert [c.index for c in r.choices] == list(range(128))
    assert len({c.text for c in r.choices}) == 1  # the same prompt, greedy


LONG = {"prompt": ["Once upon a time", "In a galaxy far away"], "max_tokens": 400, "ignore_eos": True}


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_every_prompt_of_the_batch(server, stream):
    before, logged = server.gauge("dsinfer_generation_tokens_total"), server.log.stat().st_size
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                          headers=server.headers(), timeout=60) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
            assert server.await_gauge_at_least("dsinfer_num_requests_running", 2)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=LONG, headers=server.headers(), timeout=2)
    server.wait_idle()
    generated = server.gauge("dsinfer_generation_tokens_total") - before
    assert generated < 2 * 400  # cut short, not run to the end
    if stream:  # an aborted request's tokens still count (its deltas were counted as they came)
        assert generated >= 2
    with server.log.open() as log:
        log.seek(logged)
        new = log.read()
    assert "Traceback" not in new and "unhandled error" not in new, new[-3000:]


# ---- Batch against a scripted engine: one failing or the client leaving aborts the others ----------


class _Engine:
    """A request "fail" fails after its first output; "slow" waits (until aborted) after its first; others finish
    after ``steps`` outputs. ``closed`` lists the requests whose stream ended before they finished (aborted)."""

    def __init__(self, steps: int = 3):
        self.steps = steps
        self.closed: list[str] = []

    async def generate(self, prompt, params, request_id, priority=0):
        finished = False
        try:
            for step in range(1, self.steps + 1):
                finished = step == self.steps and "slow" not in request_id
                if params.output_kind == RequestOutputKind.DELTA or finished or step == 1:
                    yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None,
                                        [CompletionOutput(0, "x", [7], finish_reason="length" if finished else None)],
                                        finished)
                if "fail" in request_id:
                    raise ProtocolError("the engine refused it", status=503)
                if "slow" in request_id:
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
        finally:
            if not finished:
                self.closed.append(request_id)


class _Request:
    """A client that disconnects once ``leave`` is set."""

    def __init__(self):
        self.leave = asyncio.Event()

    async def receive(self):
        await self.leave.wait()
        return {"type": "http.disconnect"}


def _batch(engine: _Engine, names: list[str], kind: RequestOutputKind) -> Batch:
    ctx = SimpleNamespace(metrics=ServerMetrics(), engine=engine)
    params = SamplingParams(max_tokens=engine.steps, output_kind=kind)
    return Batch([Generation(ctx, [1, 2, 3][: k + 1], params, name) for k, name in enumerate(names)])


def test_batch_finals_gathers_and_sums_usage():
    async def run():
        batch = _batch(_Engine(), ["a", "b"], RequestOutputKind.FINAL_ONLY)
        outs = await batch.finals(_Request())
        assert [out.request_id for out in outs] == ["a", "b"] and all(out.finished for out in outs)
        assert batch.usage()["prompt_tokens"] == 1 + 2 and batch.usage()["completion_tokens"] == 2

    asyncio.run(run())


def test_batch_finals_aborts_the_others_when_one_fails():
    async def run():
        engine = _Engine()
        with pytest.raises(ProtocolError, match="refused"):
            await _batch(engine, ["slow", "fail"], RequestOutputKind.FINAL_ONLY).finals(_Request())
        assert sorted(engine.closed) == ["fail", "slow"]

    asyncio.run(run())


def test_batch_finals_aborts_all_when_the_client_leaves():
    async def run():
        engine, request = _Engine(), _Request()
        task = asyncio.ensure_future(_batch(engine, ["slow", "slow2"], RequestOutputKind.FINAL_ONLY).finals(request))
        await asyncio.sleep(0.01)
        request.leave.set()
        with pytest.raises(ClientDisconnected):
            await task
        assert sorted(engine.closed) == ["slow", "slow2"]

    asyncio.run(run())


def test_batch_stream_merges_the_outputs_and_closing_it_aborts_all():
    async def run():
        engine = _Engine()
        outputs = await _batch(engine, ["a", "b"], RequestOutputKind.DELTA).outputs(_Request())
        seen = [(k, out.request_id) async for k, out in outputs]
        assert sorted(seen) == [(0, "a")] * 3 + [(1, "b")] * 3 and seen[:2] == [(0, "a"), (1, "b")]
        assert engine.closed == []

        outputs = await _batch(engine, ["slow", "slow2"], RequestOutputKind.DELTA).outputs(_Request())
        assert [k for k, _ in [await anext(outputs), await anext(outputs)]] == [0, 1]
        await outputs.aclose()  # the client went away mid-stream
        assert sorted(engine.closed) == ["slow", "slow2"]

    asyncio.run(run())


def test_batch_stream_raises_a_failure_and_aborts_the_others():
    async def run():
        engine = _Engine()
        outputs = await _batch(engine, ["slow", "fail"], RequestOutputKind.DELTA).outputs(_Request())
        with pytest.raises(ProtocolError, match="refused"):
            async for _ in outputs:
                pass
        assert sorted(engine.closed) == ["fail", "slow"]

    asyncio.run(run())
