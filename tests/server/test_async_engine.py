"""AsyncEngine with a scripted fake engine: streaming, abort on cancel, engine death, overload, draining."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.entrypoints.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestRejectedError,
)


class FakeEngine:
    """Emits token 7 once per step per request until max_tokens; ``crash_at`` steps makes step() raise."""

    def __init__(self, crash_at: int | None = None, step_s: float = 0.002):
        self.tokenizer = SimpleNamespace()
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=100)
        self.requests: dict[str, list] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.crash_at = crash_at
        self.step_s = step_s

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        if any(t >= 100 for t in prompt["prompt_token_ids"]):
            raise ValueError("out of vocabulary")
        self.requests[request_id] = [params, 0]

    def abort_request(self, ids):
        for rid in ids:
            self.aborted.append(rid)
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        if self.crash_at is not None and self.steps >= self.crash_at:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        outputs = []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0].max_tokens
            c = CompletionOutput(0, "x", [7], finish_reason="length" if done else None)
            outputs.append(RequestOutput(rid, None, [1], None, [c], done))
            if done:
                del self.requests[rid]
        return outputs

    def get_stats(self):
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_cache_usage": 0.0}


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, output_kind=RequestOutputKind.DELTA)


async def _collect(engine, rid, n=3, prompt=(1,)):
    return [o async for o in engine.generate({"prompt_token_ids": list(prompt)}, _params(n), rid)]


def test_streams_every_step_to_its_request():
    async def main():
        engine = AsyncEngine(FakeEngine())
        engine.start()
        a, b = await asyncio.gather(_collect(engine, "a", 3), _collect(engine, "b", 5))
        engine.shutdown()
        return a, b

    a, b = asyncio.run(main())
    assert [o.finished for o in a] == [False, False, True] and len(b) == 5


def test_cancelled_consumer_aborts_the_request():
    async def main():
        fake = FakeEngine(step_s=0.01)
        engine = AsyncEngine(fake)
        engine.start()
        task = asyncio.ensure_future(_collect(engine, "a", 1000))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.1)
        engine.shutdown()
        return fake, engine

    fake, engine = asyncio.run(main())
    assert fake.aborted == ["a"] and not fake.requests and engine.num_in_flight == 0


def test_bad_request_is_rejected_without_hurting_the_engine():
    async def main():
        engine = AsyncEngine(FakeEngine())
        engine.start()
        with pytest.raises(RequestRejectedError):
            await _collect(engine, "bad", prompt=(500,))
        ok = await _collect(engine, "good", 2)
        engine.shutdown()
        return ok, engine

    ok, engine = asyncio.run(main())
    assert len(ok) == 2 and not engine.dead


def test_engine_crash_fails_open_streams_and_marks_dead():
    async def main():
        engine = AsyncEngine(FakeEngine(crash_at=2))
        engine.start()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "a", 10)
        with pytest.raises(EngineDeadError):
            await _collect(engine, "b", 1)
        return engine

    engine = asyncio.run(main())
    assert engine.dead and not engine.is_healthy


def test_overload_and_draining_refuse_new_requests():
    async def main():
        engine = AsyncEngine(FakeEngine(), max_waiting=0)
        with pytest.raises(EngineOverloadedError):
            await _collect(engine, "a")
        engine.max_waiting = 10
        engine.start_draining()
        with pytest.raises(EngineDrainingError):
            await _collect(engine, "b")
        assert await engine.wait_idle(1.0)

    asyncio.run(main())


def test_cut_off_fails_in_flight_requests_and_aborts_them_in_the_engine():
    """A drain that timed out: every open stream gets EngineDrainingError, the engine drops the requests."""
    async def main():
        fake = FakeEngine(step_s=0.01)
        engine = AsyncEngine(fake)
        engine.start()
        tasks = [asyncio.ensure_future(_collect(engine, rid, 1000)) for rid in ("a", "b")]
        await asyncio.sleep(0.1)
        engine.start_draining()
        assert engine.cut_off() == 2 and engine.num_in_flight == 0
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.1)
        engine.shutdown()
        return fake, results

    fake, results = asyncio.run(main())
    assert all(isinstance(r, EngineDrainingError) for r in results)
    assert sorted(fake.aborted) == ["a", "b"] and not fake.requests


def test_request_metrics_through_the_async_engine_are_on_the_monotonic_clock(tiny_llama_dir):
    """arrival <= first scheduled <= first token <= finished, all inside the monotonic interval of the call (a
    wall-clock arrival, as time.time() gave, would lie far outside it)."""
    from dsinfer import LLM

    async def main():
        engine = AsyncEngine(LLM(str(tiny_llama_dir)).engine)
        engine.start()
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        try:
            before = time.monotonic()
            outputs = [o async for o in engine.generate({"prompt_token_ids": [1, 2, 3]}, params, "m")]
            return before, time.monotonic(), outputs[-1]
        finally:
            engine.shutdown()

    before, after, out = asyncio.run(main())
    m = out.metrics
    assert out.finished
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time <= after


def test_the_queued_prompt_token_bound_refuses_past_it_but_always_takes_a_request_into_an_empty_queue():
    async def queue_and_refuse():
        engine = AsyncEngine(FakeEngine(), max_waiting_tokens=10)  # not started yet: submissions stay queued
        big = asyncio.ensure_future(_collect(engine, "big", prompt=[1] * 25))  # over the bound, but the queue is empty
        await asyncio.sleep(0.01)
        with pytest.raises(EngineOverloadedError, match=r"25 prompt tokens are already waiting; this request's 1 "
                                                        r"would pass the limit of 10 \(--max-waiting-tokens\)"):
            await _collect(engine, "small", prompt=[1])
        engine.start()  # the engine takes "big"; the queue empties and a new request is taken again
        await asyncio.wait_for(big, 5)
        assert len(await _collect(engine, "after", prompt=[1] * 5)) >= 1
        engine.shutdown()

    asyncio.run(queue_and_refuse())
