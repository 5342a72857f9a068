"""POST /v1/completions (one prompt or a batch of them, n choices each; streaming and not)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.logprobs import completion_logprobs, prompt_completion_logprobs, prompt_logprobs_entries
from dsinfer.protocol.openai_schemas import CompletionRequest
from dsinfer.protocol.sampling import (
    build_sampling_params,
    check_logprobs_limit,
    check_prompt_ids,
    check_prompt_logprobs,
)
from dsinfer.protocol.structured_request import structured_outputs_of, validate_structured_outputs
from dsinfer.server.context import ServingContext, new_id, parse_body
from dsinfer.server.generation import Batch, Generation
from dsinfer.server.load import first_token_of
from dsinfer.server.openai_chat import prompt_ids, sampling_fields, usage_now
from dsinfer.server.sse import SSE_DONE, SSE_HEADERS, sse_data
from dsinfer.server.streaming_errors import stream_error_payload

router = APIRouter()


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one (a string or a token-id list), or a batch of either kind."""
    prompt = req.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _prepared(ctx: ServingContext, req: CompletionRequest,
              structured: dict[str, Any] | None) -> list[tuple[list[int], SamplingParams]]:
    """Every prompt's token ids and params, all checked before any runs (a batch with one bad prompt runs none);
    a batch's errors say which prompt."""
    prompts = _prompts(req)
    check_logprobs_limit(req.logprobs, ctx.max_logprobs, "logprobs")
    check_prompt_logprobs(req.prompt_logprobs, req.stream, ctx.max_logprobs, ctx.vocab_size)
    fields = sampling_fields(req)
    fields["logprobs"] = req.logprobs
    fields["structured_outputs"] = structured
    # the params differ by max_tokens and prompt_logprobs only: built once per distinct pair, as their checks
    # walk every id list (allowed_token_ids, logit_bias)
    params: dict[tuple[int, int | None], SamplingParams] = {}
    prepared = []
    for k, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, str):
                ctx.check_prompt_text(prompt)
            ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            check_prompt_ids(ids, ctx.vocab_size)
            ids = prompt_ids(ctx, req, ids)
            # an unset max_tokens is the completions' 16 (vLLM's too): the model's max_new_tokens fills in only
            # an explicit null
            max_tokens = ctx.max_tokens(1 if req.max_tokens == 0 else req.max_tokens, len(ids), "max_tokens", "prompt",
                                        clamp="max_tokens" not in req.model_fields_set)
        except ProtocolError as exc:
            if len(prompts) > 1 and exc.param in ("prompt", "max_tokens"):
                exc.message = f"prompt {k} of the batch: {exc.message}"
            raise
        # vLLM's prompt_logprobs when asked; else echo with logprobs scores the prompt too (its first token has
        # none: a one-token prompt needs no scores)
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo and req.logprobs is not None and len(ids) > 1:
            prompt_logprobs = req.logprobs
        key = (max_tokens, prompt_logprobs)
        if key not in params:
            params[key] = build_sampling_params({**fields, "max_tokens": max_tokens,
                                                 "prompt_logprobs": prompt_logprobs}, ctx.vocab_size, req.stream,
                                                ctx.sampling_defaults)
        prepared.append((ids, params[key]))
    return prepared


@router.post("/v1/completions")
async def completions(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, CompletionRequest)
    ctx.check_model(req.model)
    ctx.check_priority(req.priority)
    if req.suffix:
        raise ProtocolError("suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise ProtocolError("max_tokens must be at least 1 (0 only with echo: the prompt back, nothing generated)",
                            param="max_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise ProtocolError(f"best_of must equal n ({req.n}), got {req.best_of}", param="best_of")
    structured, field = structured_outputs_of(req)
    prepared = await asyncio.to_thread(_prepared, ctx, req, structured)  # tokenizing: off the event loop
    await validate_structured_outputs(structured, field)
    request_id = new_id("cmpl-")
    # one engine request per prompt (vLLM's ids: the answer's, then "-k"); a single prompt's is the answer's
    ids_of = [request_id] if len(prepared) == 1 else [f"{request_id}-{k}" for k in range(len(prepared))]
    first = first_token_of(request)
    if first is not None and len(prepared) != 1:
        raise ProtocolError(f"a preset first token needs one prompt, got {len(prepared)}", param="prompt")
    batch = Batch([Generation(ctx, ids, params, rid, req.priority, first)
                   for (ids, params), rid in zip(prepared, ids_of)])
    echoes = [ctx.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "" for ids, _ in prepared]
    if req.stream:
        outputs = await batch.outputs(request)
        body = _stream(ctx, req, request_id, batch, outputs, echoes)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await batch.finals(request)
    return JSONResponse(_response(ctx, req, request_id, batch, outs, echoes))


def _choice(ctx: ServingContext, req: CompletionRequest, c: Any, echo: str, offset: int,
            prompt: RequestOutput | None = None) -> tuple[dict[str, Any], int]:
    """One choice, and the text offset after its generated tokens' logprobs (a stream's next offset: the text
    itself may hold back what could begin a stop string, the logprobs never do); ``prompt`` (with ``echo``): the
    output whose prompt logprobs lead the logprobs. With ``max_tokens: 0`` (echo only) the one token the engine
    made is dropped: the choice is the prompt alone, as vLLM's and the OpenAI legacy API's."""
    if req.max_tokens == 0:
        c = dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                finish_reason="length" if c.finish_reason else None, stop_reason=None)
    logprobs = None
    if req.logprobs is not None:
        as_ids = ctx.tokens_as_ids(req.return_tokens_as_token_ids)
        logprobs, offset = completion_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, req.logprobs, offset, as_ids)
        if echo and prompt is not None and prompt.prompt_token_ids:
            positions = prompt.prompt_logprobs or [None] * len(prompt.prompt_token_ids)  # one token: unscored
            head = prompt_completion_logprobs(ctx.tokenizer, prompt.prompt_token_ids, positions, req.logprobs,
                                              as_ids)
            logprobs = {key: head[key] + logprobs[key] for key in logprobs}
    else:
        offset += len(c.text)
    choice = {"index": c.index, "text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}  # vLLM's: the stop string or token id that ended it
    if req.return_token_ids and not req.stream:
        choice["token_ids"] = list(c.token_ids)
    return choice, offset


def _usage(req: CompletionRequest, batch: Batch) -> dict[str, Any]:
    """The batch's usage; with ``max_tokens: 0`` (echo only) none of the token the engine made is counted."""
    usage = batch.usage()
    if req.max_tokens == 0:
        usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
    return usage


def _response(ctx: ServingContext, req: CompletionRequest, request_id: str, batch: Batch,
              outs: list[RequestOutput], echoes: list[str]) -> dict[str, Any]:
    choices = []
    for k, (out, echo) in enumerate(zip(outs, echoes)):
        for c in sorted(out.outputs, key=lambda c: c.index):
            choice = _choice(ctx, req, c, echo, len(echo), out)[0]
            if req.prompt_logprobs is not None:  # vLLM's: on each choice, its prompt's (never streamed)
                choice["prompt_logprobs"] = prompt_logprobs_entries(ctx.tokenizer, out.prompt_logprobs)
            choices.append({**choice, "index": k * req.n + c.index})  # prompt k's choices follow prompt k-1's
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.reported_model(req.model),
        "choices": choices,
        "usage": _usage(req, batch),
        "system_fingerprint": None,
    }


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    batch: Batch,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    echoes: list[str],
) -> AsyncIterator[str]:
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.reported_model(req.model),
    }
    # per choice of the answer: prompt k's choice i is k * n + i
    offsets = [len(echo) for echo in echoes for _ in range(req.n)]
    echoed = [not echo for echo in echoes for _ in range(req.n)]
    try:
        async for k, out in outputs:
            for c in out.outputs:  # the choices with news; a finished one once
                index = k * req.n + c.index
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                prefix = "" if echoed[index] else echoes[k]
                echoed[index] = True
                choice, offsets[index] = _choice(ctx, req, c, prefix, offsets[index], out)
                yield sse_data({**base, "choices": [{**choice, "index": index}],
                                **usage_now(req, batch, before_output=req.max_tokens == 0)})
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_data(stream_error_payload(exc))
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_data({**base, "choices": [], "usage": _usage(req, batch)})
    yield SSE_DONE
