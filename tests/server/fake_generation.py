"""A generation's outputs without an engine: what a route's ``_stream`` consumes, for tests of the event formats."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.server.settings import ServerSettings


def fake_stream(pieces: list[str], request_id: str, model: str):
    """(ctx, gen, outputs): a serving context and generation as ``_stream`` reads them, and the outputs of a
    generation arriving in ``pieces`` (one token each, the last one finished with "stop")."""
    outs = [RequestOutput("r", None, [1], None, [CompletionOutput(0, piece, [i], finish_reason=None)], False)
            for i, piece in enumerate(pieces)]
    outs[-1].outputs[0].finish_reason, outs[-1].finished = "stop", True

    async def outputs() -> AsyncIterator[RequestOutput]:
        for out in outs:
            yield out

    # a stand-in tokenizer of one token a word: what a route counts with it (the Responses API's reasoning tokens)
    words = SimpleNamespace(encode=lambda text, add_special_tokens=True: text.split())
    ctx = SimpleNamespace(reported_model=lambda _: model, settings=ServerSettings(), tokenizer=words)
    gen = SimpleNamespace(request_id=request_id, prompt_ids=[1], num_generated=len(pieces), num_cached=0)
    return ctx, gen, outputs()


def anthropic_final_message(sse: list[str]):
    """What the anthropic SDK's stream helper makes of these SSE events: a client's ``get_final_message()``."""
    import anthropic
    import httpx
    from anthropic.lib.streaming import MessageStream
    from anthropic.types import RawMessageStreamEvent

    request = httpx.Request("POST", "http://127.0.0.1/v1/messages")
    response = httpx.Response(200, content="".join(sse).encode(), headers={"content-type": "text/event-stream"},
                              request=request)
    sdk = anthropic.Anthropic(api_key="sk-unused", base_url="http://127.0.0.1")
    stream = MessageStream(anthropic.Stream(cast_to=RawMessageStreamEvent, response=response, client=sdk),
                           anthropic.NOT_GIVEN)
    return stream.get_final_message()
