"""The engine tokenizer as the server uses it: from a worker thread (``asyncio.to_thread``), a long prompt must
leave the event loop its turns, and the ids must equal the single-text encode's."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_llm) -> Tokenizer:
    return smollm2_llm.engine.tokenizer


@pytest.mark.parametrize("text", ["", "Hello world", "naïve café — 日本語 🙂", "a<|im_end|>b <|im_start|>user\n"])
def test_encode_gives_the_backends_ids(tok, text):
    for special in (True, False):
        assert tok.encode(text, add_special_tokens=special) == tok.backend.encode(text,
                                                                                  add_special_tokens=special).ids
    literal = tok.encode_literal(text)
    assert not set(literal) & tok.special_token_ids


def test_a_long_encode_in_a_thread_leaves_the_event_loop_its_turns(tok):
    """Before: ``tokenizers``' single-text encode held the GIL throughout, so a server thread tokenizing a 6 MB
    prompt stopped every other request (and /health) for seconds. The loop below must tick many times during
    an encode that takes at least a quarter of a second; the bound on the largest gap is half the encode, far
    above a tick even on a loaded 2-core machine, and far below a held GIL's gap (the whole encode)."""
    text = "a " * (1 << 19)

    async def run() -> tuple[float, float]:
        task = asyncio.ensure_future(asyncio.to_thread(tok.encode, text))
        start = last = time.perf_counter()
        largest = 0.0
        while not task.done():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            largest, last = max(largest, now - last), now
        assert len(await task) > 1000
        return time.perf_counter() - start, largest

    took, largest = asyncio.run(run())
    while took < 0.25:  # a fast machine: a longer text, so the bound below still separates the two cases
        text *= 4
        took, largest = asyncio.run(run())
    assert largest < took / 2, f"the event loop waited {largest:.2f} s of a {took:.2f} s encode"
