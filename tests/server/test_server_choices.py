"""Several choices (n > 1) streamed through the openai SDK, and the model card's vLLM fields."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.server.generation import Generation
from dsinfer.server.metrics import ServerMetrics

from .live_server import MAX_MODEL_LEN

# seeded so that the three choices stop (on a stop string or EOS) at different steps
SAMPLING = dict(n=3, max_tokens=25, temperature=0.9, seed=7, stop=[", ", "\n", " "])


def _text(choice, chat: bool) -> str:
    return (choice.delta.content or "") if chat else choice.text


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_each_streamed_choice_ends_once(client, model, chat):
    """A choice that stops before the others gets one chunk with its finish_reason, and none after it (the engine
    keeps reporting finished choices while their siblings run); its text and the usage match the answer without
    streaming."""
    if chat:
        create = client.chat.completions.create
        body = dict(model=model, messages=[{"role": "user", "content": "List of fruits"}], **SAMPLING)
    else:
        create = client.completions.create
        body = dict(model=model, prompt="List of fruits:", logprobs=1, **SAMPLING)
    whole = create(**body)
    chunks = list(create(**body, stream=True, stream_options={"include_usage": True}))
    texts, ends, tokens = ["", "", ""], [[], [], []], [0, 0, 0]
    for step, chunk in enumerate(chunks):
        for choice in chunk.choices:
            assert not ends[choice.index], f"choice {choice.index} has a chunk after its finish_reason"
            texts[choice.index] += _text(choice, chat)
            if choice.logprobs is not None:
                tokens[choice.index] += len(choice.logprobs.content or [] if chat else choice.logprobs.tokens)
            if choice.finish_reason is not None:
                ends[choice.index].append(step)
    assert all(len(e) == 1 for e in ends), ends
    assert len({e[0] for e in ends}) > 1, "the choices should end at different steps"
    by_index = sorted(whole.choices, key=lambda c: c.index)
    assert texts == [c.message.content if chat else c.text for c in by_index]
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    if not chat:
        assert tokens == [len(c.logprobs.tokens) for c in by_index] and sum(tokens) == usage.completion_tokens


def test_seeded_choices_repeat_and_differ(client, model):
    body = dict(model=model, prompt="Once upon a time", n=2, max_tokens=12, temperature=1.0, seed=11)
    first, again = client.completions.create(**body), client.completions.create(**body)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text


def test_model_card_has_vllm_fields(server, client, model):
    card = client.models.retrieve(model).model_dump()
    assert card["id"] == model and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] == model and card["parent"] is None
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"] and not permission["is_blocking"]
    listed = client.models.list().data[0].model_dump()
    assert {k: v for k, v in listed.items() if k != "permission"} == {k: v for k, v in card.items()
                                                                     if k != "permission"}


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_time_per_output_token_counts_steps_not_the_choices_tokens(kind):
    """n choices of 5 tokens each take 5 decode steps: the time per output token is the time after the first
    token over 4 steps, not over the 5 * n - 1 tokens of every choice together."""
    n, steps = 3, 5

    async def generate(prompt, params, request_id, priority=0):
        for step in range(1, steps + 1):
            last = step == steps
            if kind == RequestOutputKind.DELTA or last:
                emitted = [7] if kind == RequestOutputKind.DELTA else [7] * steps
                yield RequestOutput(request_id, None, [1, 2], None, [
                    CompletionOutput(i, "x" * len(emitted), emitted, finish_reason="length" if last else None)
                    for i in range(n)
                ], last)

    ctx = SimpleNamespace(metrics=ServerMetrics(), engine=SimpleNamespace(generate=generate))
    params = SamplingParams(n=n, max_tokens=steps, output_kind=kind)
    gen = Generation(ctx, [1, 2], params, "cmpl-test")

    async def run() -> None:
        async for _ in gen.outputs():
            pass

    asyncio.run(run())
    metrics = ctx.metrics
    assert gen.usage()["completion_tokens"] == n * steps
    assert metrics.generation_tokens._value.get() == n * steps
    e2e, tpot = _sum(metrics.e2e), _sum(metrics.tpot)
    assert tpot == pytest.approx((e2e - (gen.first_token - gen.start)) / (steps - 1))


def _sum(histogram) -> float:
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_sum"))
