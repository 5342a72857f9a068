"""POST /v1/completions (one prompt per request; streaming and not)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsinfer.engine.outputs import RequestOutput
from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.logprobs import completion_logprobs, prompt_completion_logprobs
from dsinfer.protocol.openai_schemas import CompletionRequest
from dsinfer.protocol.sampling import build_sampling_params, check_prompt_ids, resolve_max_tokens
from dsinfer.protocol.structured_request import structured_outputs_of, validate_structured_outputs
from dsinfer.server.context import ServingContext, new_id, parse_body
from dsinfer.server.generation import Generation, primed
from dsinfer.server.openai_chat import prompt_ids, sampling_fields, usage_now
from dsinfer.server.sse import SSE_DONE, SSE_HEADERS, sse_data
from dsinfer.server.streaming_errors import stream_error_payload

router = APIRouter()


def _prompt_ids(ctx: ServingContext, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # the schema allows exactly one element
    ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    check_prompt_ids(ids, ctx.vocab_size)
    return ids


@router.post("/v1/completions")
async def completions(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, CompletionRequest)
    ctx.check_model(req.model)
    if req.suffix:
        raise ProtocolError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ProtocolError(f"best_of must equal n ({req.n}), got {req.best_of}", param="best_of")
    ids = prompt_ids(ctx, req, _prompt_ids(ctx, req))
    fields = sampling_fields(req)
    fields.update(
        max_tokens=resolve_max_tokens(req.max_tokens, len(ids), ctx.max_model_len, "max_tokens", "prompt",
                                      clamp="max_tokens" not in req.model_fields_set),
        logprobs=req.logprobs,
        # echo with logprobs scores the prompt too (its first token has none: a one-token prompt needs no scores)
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None and len(ids) > 1 else None,
    )
    structured, field = structured_outputs_of(req)
    fields["structured_outputs"] = structured
    params = build_sampling_params(fields, ctx.vocab_size, req.stream)
    await validate_structured_outputs(structured, field)
    gen = Generation(ctx, ids, params, new_id("cmpl-"))
    echo = ctx.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
    if req.stream:
        outputs = await primed(request, gen.outputs())
        return StreamingResponse(
            _stream(ctx, req, gen, outputs, echo), media_type="text/event-stream", headers=SSE_HEADERS
        )
    out = await gen.final(request)
    return JSONResponse(_response(ctx, req, gen, out, echo))


def _choice(ctx: ServingContext, req: CompletionRequest, c: Any, echo: str, offset: int,
            prompt: RequestOutput | None = None) -> tuple[dict[str, Any], int]:
    """One choice, and the text offset after its generated tokens' logprobs (a stream's next offset: the text
    itself may hold back what could begin a stop string, the logprobs never do); ``prompt`` (with ``echo``): the
    output whose prompt logprobs lead the logprobs."""
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, req.logprobs, offset)
        offset += sum(len(token) for token in logprobs["tokens"])
        if echo and prompt is not None and prompt.prompt_token_ids:
            positions = prompt.prompt_logprobs or [None] * len(prompt.prompt_token_ids)  # one token: unscored
            head = prompt_completion_logprobs(ctx.tokenizer, prompt.prompt_token_ids, positions, req.logprobs)
            logprobs = {key: head[key] + logprobs[key] for key in logprobs}
    else:
        offset += len(c.text)
    choice = {"index": c.index, "text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
    return choice, offset


def _response(
    ctx: ServingContext, req: CompletionRequest, gen: Generation, out: RequestOutput, echo: str
) -> dict[str, Any]:
    choices = [_choice(ctx, req, c, echo, len(echo), out)[0] for c in sorted(out.outputs, key=lambda c: c.index)]
    return {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.reported_model(req.model),
        "choices": choices,
        "usage": gen.usage(),
        "system_fingerprint": None,
    }


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    gen: Generation,
    outputs: AsyncIterator[RequestOutput],
    echo: str,
) -> AsyncIterator[str]:
    base = {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.reported_model(req.model),
    }
    offsets = [len(echo)] * req.n
    echoed = [not echo] * req.n
    ended = [False] * req.n  # the engine keeps reporting a finished choice while its siblings run
    try:
        async for out in outputs:
            for c in out.outputs:
                if ended[c.index] or (not c.text and not c.token_ids and c.finish_reason is None):
                    continue
                ended[c.index] = c.finish_reason is not None
                prefix = "" if echoed[c.index] else echo
                echoed[c.index] = True
                choice, offsets[c.index] = _choice(ctx, req, c, prefix, offsets[c.index], out)
                yield sse_data({**base, "choices": [choice], **usage_now(req, gen)})
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_data(stream_error_payload(exc))
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_data({**base, "choices": [], "usage": gen.usage()})
    yield SSE_DONE
