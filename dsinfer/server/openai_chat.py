"""POST /v1/chat/completions (streaming and not)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import SamplingParams, truncate_prompt
from dsinfer.protocol.chat_output import ChatOutputParser, OutputDelta, parse_output
from dsinfer.protocol.conversation import openai_chat_messages, openai_chat_tools
from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.fields import stop_list
from dsinfer.protocol.logprobs import chat_logprobs, prompt_logprobs_entries
from dsinfer.protocol.openai_schemas import ChatCompletionRequest, NamedToolChoice, SamplingFields
from dsinfer.protocol.sampling import (
    build_sampling_params,
    check_logprobs_limit,
    check_prompt_logprobs,
    logit_bias_ids,
)
from dsinfer.protocol.structured_request import structured_outputs_of, validate_structured_outputs
from dsinfer.protocol.tool_constraints import (
    ToolSpec,
    forced_tool_names,
    tool_call_constraint,
    with_tool_constraint,
)
from dsinfer.server.context import ServingContext, new_id, parse_body
from dsinfer.server.generation import Batch, Generation, primed
from dsinfer.server.load import first_token_of
from dsinfer.server.sse import SSE_DONE, SSE_HEADERS, sse_data
from dsinfer.server.streaming_errors import stream_error_payload

router = APIRouter()


def sampling_fields(req: SamplingFields) -> dict[str, Any]:
    """The SamplingParams fields common to chat and text completions (after the check they share: stream_options
    needs stream)."""
    if req.stream_options is not None and not req.stream:
        raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
    return dict(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        stop=stop_list(req.stop),
        stop_token_ids=req.stop_token_ids,
        min_tokens=req.min_tokens,
        logit_bias=logit_bias_ids(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        kv_retention=req.kv_retention,
    )


def prompt_ids(ctx: ServingContext, req: SamplingFields, token_ids: list[int]) -> list[int]:
    """The prompt the engine runs: ``truncate_prompt_tokens`` applied, so that max_tokens and usage count it."""
    return truncate_prompt(token_ids, req.truncate_prompt_tokens, ctx.max_model_len)


def usage_now(req: SamplingFields, gen: Generation | Batch, before_output: bool = False) -> dict[str, Any]:
    """``{"usage": ...}`` for every streamed chunk when ``stream_options`` asks for continuous usage stats (with
    include_usage, as vLLM), else nothing. ``before_output``: a chunk sent ahead of every token (the role's),
    though the first output has already been read (``primed``): no completion tokens yet."""
    options = req.stream_options
    if options is not None and options.include_usage and options.continuous_usage_stats:
        usage = gen.usage()
        if before_output:
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        return {"usage": usage}
    return {}


def _params(
    ctx: ServingContext, req: ChatCompletionRequest, prompt_len: int, use_tools: bool,
    structured: dict[str, Any] | None,
) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
    check_logprobs_limit(req.top_logprobs, ctx.max_logprobs, "top_logprobs")
    check_prompt_logprobs(req.prompt_logprobs, req.stream, ctx.max_logprobs, ctx.vocab_size)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    fields = sampling_fields(req)
    fields.update(
        max_tokens=ctx.max_tokens(requested, prompt_len, param),
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        structured_outputs=structured,
    )
    if use_tools and ctx.tool_markers_special:
        fields["skip_special_tokens"] = False
    return build_sampling_params(fields, ctx.vocab_size, req.stream, ctx.sampling_defaults)


def _role(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """The answer's role, as vLLM's: the server's ``--response-role`` after a generation prompt, else (the prompt
    ends inside the last message, continued) that message's role."""
    if req.add_generation_prompt and not req.continue_final_message:
        return ctx.settings.response_role
    return req.messages[-1].role


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, c: Any) -> dict[str, Any]:
    as_ids = ctx.tokens_as_ids(req.return_tokens_as_token_ids)
    return {"content": chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0, as_ids)}


def _tool_choice_constraint(ctx: ServingContext, req: ChatCompletionRequest) -> dict[str, Any] | None:
    tools = [ToolSpec(t.function.name, t.function.parameters, bool(t.function.strict)) for t in req.tools or []]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):  # a named function
        return tool_call_constraint(tools, "named", ctx.tool_parser, choice.function.name)
    return tool_call_constraint(tools, choice or "auto", ctx.tool_parser, parallel=req.parallel_tool_calls)


def _forced_tools(req: ChatCompletionRequest) -> tuple[str, ...]:
    names = [t.function.name for t in req.tools or []]
    if isinstance(req.tool_choice, NamedToolChoice):
        return forced_tool_names(names, "named", req.tool_choice.function.name)
    return forced_tool_names(names, req.tool_choice or "auto")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    ctx.check_priority(req.priority)
    use_tools = bool(req.tools) and req.tool_choice != "none"  # the answer is parsed for tool calls
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise ProtocolError("continue_final_message and add_generation_prompt cannot both be true",
                            param="continue_final_message")
    messages = openai_chat_messages(req.messages)
    encoded = await ctx.encode_chat(
        messages,
        openai_chat_tools(req.tools) if ctx.prompt_has_tools(req.tools, req.tool_choice == "none") else None,
        req.chat_template,
        req.chat_template_kwargs,
        req.add_generation_prompt and not req.continue_final_message,
        req.continue_final_message,
    )
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
    structured, field = with_tool_constraint(*structured_outputs_of(req), _tool_choice_constraint(ctx, req), forced,
                                             "response_format")
    ids = prompt_ids(ctx, req, encoded.token_ids)
    params = _params(ctx, req, len(ids), use_tools, structured)
    await validate_structured_outputs(structured, field)
    gen = Generation(ctx, ids, params, new_id("chatcmpl-"), req.priority, first_token_of(request))
    parser_kwargs = ctx.output_parser_kwargs(encoded.text, use_tools, req.parallel_tool_calls, _forced_tools(req))
    echo = (messages[-1]["content"] or "") if req.echo and req.messages[-1].role == _role(ctx, req) else ""
    if req.stream:
        outputs = await primed(request, gen.outputs())
        body = _stream(ctx, req, gen, outputs, parser_kwargs, echo)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    out = await gen.final(request)
    return JSONResponse(_response(ctx, req, gen, out, parser_kwargs, echo))


def _tool_calls(delta: OutputDelta, first_index: int) -> list[dict[str, Any]]:
    return [
        {
            "index": first_index + k,
            "id": new_id("call_")[:29],
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for k, call in enumerate(delta.tool_calls)
    ]


def _messages(message: dict[str, Any], delta: OutputDelta) -> list[dict[str, Any]]:
    """The chunk deltas for one output: its text (``message``) with the first tool-call part, then one chunk for
    each further part, as vLLM and OpenAI stream a call: first index, id, type and name with arguments "", then
    the index and an arguments fragment only."""
    messages = [message]
    for part in delta.tool_call_parts:
        if part.name is not None:
            call = {"index": part.index, "id": new_id("call_")[:29], "type": "function",
                    "function": {"name": part.name, "arguments": ""}}
        else:
            call = {"index": part.index, "function": {"arguments": part.arguments}}
        if "tool_calls" in messages[-1]:
            messages.append({})
        messages[-1]["tool_calls"] = [call]
    return messages


def _finish_reason(reason: str | None, made_calls: bool, req: ChatCompletionRequest) -> str | None:
    """The choice's finish_reason: "tool_calls" when the model chose to call (``auto``/``required``); a call forced
    by a named ``tool_choice`` ends with "stop", as OpenAI and vLLM answer it."""
    if reason == "stop" and made_calls and not isinstance(req.tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason


def _response(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    gen: Generation,
    out: RequestOutput,
    parser_kwargs: dict[str, Any],
    echo: str = "",
) -> dict[str, Any]:
    """The chat.completion body; ``echo``: the last message's text, put before each answer (vLLM's ``echo``)."""
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        parsed = parse_output(c.text, c.finish_reason == "length", **parser_kwargs)
        message: dict[str, Any] = {"role": _role(ctx, req), "content": parsed.content}
        if parsed.tool_calls:
            # the text around the calls as the stream sends it (whitespace kept, as vLLM's); None when blank
            message["content"] = parsed.content if parsed.content.strip() else None
            message["tool_calls"] = [
                {k: v for k, v in tc.items() if k != "index"} for tc in _tool_calls(parsed, 0)
            ]
        if echo:
            message["content"] = echo + (message["content"] or "")
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _logprobs(ctx, req, c) if req.logprobs else None,
                "finish_reason": _finish_reason(c.finish_reason, bool(parsed.tool_calls), req),
                "stop_reason": c.stop_reason,  # vLLM's: the stop string or token id that ended it
                **({"token_ids": list(c.token_ids)} if req.return_token_ids else {}),
            }
        )
    body = {
        "id": gen.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.reported_model(req.model),
        "choices": choices,
        "usage": gen.usage(),
        "system_fingerprint": None,
    }
    if req.prompt_logprobs is not None:  # vLLM's: the prompt's logprobs, beside the choices
        body["prompt_logprobs"] = prompt_logprobs_entries(ctx.tokenizer, out.prompt_logprobs)
    return body


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    gen: Generation,
    outputs: AsyncIterator[RequestOutput],
    parser_kwargs: dict[str, Any],
    echo: str = "",
) -> AsyncIterator[str]:
    base = {
        "id": gen.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": ctx.reported_model(req.model),
    }
    parsers = [ChatOutputParser(**parser_kwargs) for _ in range(req.n)]
    for i in range(req.n):
        choice = {
            "index": i,
            "delta": {"role": _role(ctx, req), "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield sse_data({**base, "choices": [choice], **usage_now(req, gen, before_output=True)})
    for i in range(req.n if echo else 0):  # the echoed text in a chunk of its own, as vLLM sends it
        choice = {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
        yield sse_data({**base, "choices": [choice], **usage_now(req, gen, before_output=True)})
    try:
        async for out in outputs:
            for c in out.outputs:  # a streamed output holds the choices with news; a finished one once
                delta = parsers[c.index].feed(c.text)
                if c.finish_reason is not None:
                    delta.extend(parsers[c.index].finish(cut_off=c.finish_reason == "length"))
                message: dict[str, Any] = {}
                if delta.reasoning:
                    message["reasoning_content"] = delta.reasoning
                if delta.content:
                    message["content"] = delta.content
                logprobs = _logprobs(ctx, req, c) if req.logprobs and c.token_ids else None
                made_calls = bool(parsers[c.index].total.tool_calls)
                finish = _finish_reason(c.finish_reason, made_calls, req)
                messages = _messages(message, delta)
                for k, delta_message in enumerate(messages):
                    if not delta_message and logprobs is None and c.finish_reason is None:
                        continue
                    last = k == len(messages) - 1
                    choice = {"index": c.index, "delta": delta_message, "logprobs": logprobs if k == 0 else None,
                              "finish_reason": finish if last else None, "stop_reason": c.stop_reason if last else None}
                    yield sse_data({**base, "choices": [choice], **usage_now(req, gen)})
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_data(stream_error_payload(exc))
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_data({**base, "choices": [], "usage": gen.usage()})
    yield SSE_DONE
