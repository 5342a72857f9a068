"""POST /v1/responses (stateless: no ``store``/``previous_response_id``), streaming and not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsinfer.engine.outputs import RequestOutput
from dsinfer.protocol.chat_output import ChatOutputParser, OutputDelta, ToolCallPart
from dsinfer.protocol.conversation import responses_messages, responses_tools
from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.logprobs import chat_logprobs
from dsinfer.protocol.responses_schemas import NamedFunction, ResponsesRequest
from dsinfer.protocol.sampling import build_sampling_params, check_logprobs_limit
from dsinfer.protocol.structured_request import text_format_constraint, validate_structured_outputs
from dsinfer.protocol.tool_constraints import (
    ToolSpec,
    forced_tool_names,
    tool_call_constraint,
    with_tool_constraint,
)
from dsinfer.protocol.tool_parsers import ParsedToolCall
from dsinfer.server.context import ServingContext, new_id, parse_body
from dsinfer.server.generation import Generation, primed
from dsinfer.server.sse import SSE_HEADERS, sse_event
from dsinfer.server.streaming_errors import stream_error_payload

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, ResponsesRequest)
    ctx.check_model(req.model)
    ctx.check_priority(req.priority)
    unsupported = {
        "previous_response_id": "this server does not store responses",
        "conversation": "this server does not store conversations",
        "prompt": "this server has no stored prompt templates",
        "background": "responses run in the request (no background mode)",
    }
    for field, why in unsupported.items():
        if getattr(req, field) not in (None, False):
            raise ProtocolError(f"{field} is not supported: {why}", param=field)
    use_tools = bool(req.tools) and req.tool_choice != "none"  # the answer is parsed for tool calls
    tools = responses_tools(req) if ctx.prompt_has_tools(req.tools, req.tool_choice == "none") else None
    encoded = await ctx.encode_chat(responses_messages(req), tools)
    structured = text_format_constraint(req.text.format if req.text is not None else None)
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedFunction)
    structured, field = with_tool_constraint(structured, "text.format" if structured is not None else None,
                                             _tool_choice_constraint(ctx, req), forced, "text.format")
    fields = dict(
        max_tokens=ctx.max_tokens(req.max_output_tokens, len(encoded.token_ids), "max_output_tokens", "input"),
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        logprobs=req.output_logprobs,
        structured_outputs=structured,
        kv_retention=req.kv_retention,
    )
    if use_tools and ctx.tool_markers_special:
        fields["skip_special_tokens"] = False
    check_logprobs_limit(req.top_logprobs, ctx.max_logprobs, "top_logprobs")
    params = build_sampling_params(fields, ctx.vocab_size, req.stream, ctx.sampling_defaults)
    await validate_structured_outputs(structured, field)
    gen = Generation(ctx, encoded.token_ids, params, new_id("resp_"), req.priority)
    names, choice = [t.name for t in req.tools or []], req.tool_choice
    forced_names = (forced_tool_names(names, "named", choice.name) if isinstance(choice, NamedFunction)
                    else forced_tool_names(names, choice or "auto"))
    parser_kwargs = ctx.output_parser_kwargs(encoded.text, use_tools, req.parallel_tool_calls, forced_names)
    if req.stream:
        outputs = await primed(request, gen.outputs())
        return StreamingResponse(
            _stream(ctx, req, gen, outputs, parser_kwargs),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    out = await gen.final(request)
    c = out.outputs[0]
    items, parsed = answer_items(c.text, c.finish_reason, parser_kwargs, _logprobs(ctx, req, c.token_ids, c.logprobs))
    reasoning_tokens = await _reasoning_tokens(ctx, parsed.reasoning)
    return JSONResponse(_response(ctx, req, gen, items, c.finish_reason, reasoning_tokens=reasoning_tokens))


def _logprobs(ctx: ServingContext, req: ResponsesRequest, token_ids: list[int], positions) -> list[dict[str, Any]]:
    """``output_text.logprobs`` entries (chat's format) of these tokens when the request includes them. Every
    generated token is scored in the answer's text, reasoning or tool-call tokens included, as vLLM. Tokens are
    ``token_id:N`` under --return-tokens-as-token-ids: vLLM's Responses API follows the server flag only (its
    request has no ``return_tokens_as_token_ids``; the field is ignored here as there)."""
    if req.output_logprobs is None:
        return []
    return chat_logprobs(ctx.tokenizer, token_ids, positions, req.output_logprobs, ctx.tokens_as_ids(None))


async def _reasoning_tokens(ctx: ServingContext, reasoning: str) -> int:
    """``output_tokens_details.reasoning_tokens``: the reasoning text's tokens, counted by encoding it again (the
    parsers split text, not tokens; a generated text re-encodes to its own tokens but at rare merges), off the
    event loop as every encoding."""
    if not reasoning:
        return 0
    return len(await asyncio.to_thread(ctx.tokenizer.encode, reasoning, add_special_tokens=False))


def _tool_choice_constraint(ctx: ServingContext, req: ResponsesRequest) -> dict[str, Any] | None:
    """The constraint that enforces ``tool_choice`` ("required", a named function, or strict tools)."""
    tools = [ToolSpec(t.name, t.parameters, bool(t.strict)) for t in req.tools or []]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):  # a named function
        return tool_call_constraint(tools, "named", ctx.tool_parser, choice.name)
    return tool_call_constraint(tools, choice or "auto", ctx.tool_parser, parallel=req.parallel_tool_calls)


def _message_item(text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None
                  ) -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_id("msg_"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}],
    }


def _reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": new_id("rs_"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _call_item(name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_id("fc_"),
        "call_id": new_id("call_")[:29],
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def answer_items(text: str, finish_reason: str | None, parser_kwargs: dict[str, Any],
                 logprobs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], OutputDelta]:
    """The non-streamed answer's output items, and the parse they come from. The item max_output_tokens cut short
    is "incomplete" (OpenAI): a call read only in part (its arguments so far, as the stream sent them), else the
    last text; none when the cut fell right after a whole call."""
    cut = finish_reason == "length"
    parser = ChatOutputParser(**parser_kwargs)
    parser.feed(text)
    tail = parser.finish(cut_off=cut)  # a call it ends was cut off: the stream's rule (``_EventWriter.cut``)
    items = _items(parser.total, logprobs)
    if cut:
        cut_item = items[-1] if tail.tool_calls else next(
            (item for item in reversed(items) if item["type"] in ("message", "reasoning")), None)
        if cut_item is not None:
            cut_item["status"] = "incomplete"
    return items, parser.total


def _items(parsed: OutputDelta, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items = [_reasoning_item(parsed.reasoning)] if parsed.reasoning else []
    if parsed.content.strip() or not parsed.tool_calls:
        items.append(_message_item(parsed.content, logprobs=logprobs))
    items.extend(_call_item(c.name, c.arguments) for c in parsed.tool_calls)
    return items


def _response(
    ctx: ServingContext,
    req: ResponsesRequest,
    gen: Generation,
    items: list[dict[str, Any]],
    finish_reason: str | None,
    status: str | None = None,
    created_at: int | None = None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """The response object; ``status`` "in_progress" (a stream's first events) has no usage yet, as OpenAI's."""
    incomplete = finish_reason == "length"
    status = status or ("incomplete" if incomplete else "completed")
    return {
        "id": gen.request_id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": status,
        "model": ctx.reported_model(req.model),
        "output": items,
        "instructions": req.instructions,
        "incomplete_details": {"reason": "max_output_tokens"}
        if incomplete and status == "incomplete"
        else None,
        "error": None,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "tools": [t.model_dump() for t in req.tools or []],
        "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
        else req.tool_choice or "auto",
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
        "parallel_tool_calls": req.parallel_tool_calls,
        "store": False,
        "metadata": req.metadata or {},
        "usage": None if status == "in_progress" else {
            "input_tokens": len(gen.prompt_ids),
            "output_tokens": gen.num_generated,
            "total_tokens": len(gen.prompt_ids) + gen.num_generated,
            # cache_write_tokens (required by the openai SDK's ResponseUsage; vLLM leaves it out): prompt caching
            # here is the engine's automatic prefix cache, which bills nothing for writes and reports none, so 0,
            # as the Anthropic route's cache_creation_input_tokens
            "input_tokens_details": {"cached_tokens": gen.num_cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, gen.num_generated)},
        },
    }


class _EventWriter:
    """Numbers events and tracks the output items opened so far: a reasoning item, a message item (each with one
    content part, open while its text streams), function calls; in the order the final response lists them."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None  # the open message or reasoning item
        self.call: tuple[int, dict[str, Any]] | None = None  # (part index, item) of the function call streaming
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens not yet carried by a text delta
        # whitespace before any message text: it opens no message by itself (a call may follow, beside which the
        # non-streamed answer drops whitespace-only text), but leads the text if text comes
        self.space = ""
        self.cut = False  # the answer's end is being written and max_output_tokens cut it: a call ending now is
        # one read in part

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def _open(self, item: dict[str, Any]) -> list[str]:
        events = self.close_call() + self.close_text()
        self.text = item
        self.items.append(item)
        idx, part = len(self.items) - 1, item["content"][0]
        return events + [  # the item is announced without its part (as OpenAI), which comes next
            self.event("response.output_item.added", output_index=idx, item={**item, "content": []}),
            self.event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                       part=part),
        ]

    def open_text(self) -> list[str]:
        return self._open(_message_item("", status="in_progress"))

    def text_delta(self, delta: str) -> list[str]:
        """A text delta; it carries the logprobs of the tokens scored since the last one (``pending``)."""
        events = []
        if self.text is None or self.text["type"] != "message":
            if not (self.space + delta).strip():
                self.space += delta
                return []
            delta, self.space = self.space + delta, ""
            events = self.open_text()
        part = self.text["content"][0]
        part["text"] += delta
        part["logprobs"] += self.pending
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=delta,
                logprobs=self.pending,
            )
        )
        self.pending = []
        return events

    def reasoning_delta(self, delta: str) -> list[str]:
        events = []
        if self.text is None or self.text["type"] != "reasoning":
            events = self._open({**_reasoning_item(""), "status": "in_progress"})
        self.text["content"][0]["text"] += delta
        return events + [self.event("response.reasoning_text.delta", item_id=self.text["id"],
                                    output_index=len(self.items) - 1, content_index=0, delta=delta)]

    def finish(self, cut: bool) -> list[str]:
        """The open item closed ("incomplete" when ``cut`` by max_output_tokens, as OpenAI); an answer with neither
        message nor call gets a message (empty, or the whitespace held back), as the non-streamed one."""
        events = []
        if not any(item["type"] != "reasoning" for item in self.items):
            events = self.open_text()
            if self.space:
                events += self.text_delta(self.space)
        return events + self.close_call() + self.close_text("incomplete" if cut else "completed")

    def close_text(self, status: str = "completed") -> list[str]:
        if self.text is None:
            return []
        item, self.text = self.text, None
        item["status"] = status
        idx, part = self.items.index(item), item["content"][0]
        ids = dict(item_id=item["id"], output_index=idx, content_index=0)
        if item["type"] == "reasoning":
            done = self.event("response.reasoning_text.done", **ids, text=part["text"])
        else:
            part["logprobs"] += self.pending  # tokens whose text never became a delta (held back, or markup)
            self.pending = []
            done = self.event("response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"])
        return [
            done,
            self.event("response.content_part.done", **ids, part=part),
            self.event("response.output_item.done", output_index=idx, item=item),
        ]

    def _call_parts(self, parts: list[ToolCallPart], ended: dict[int, ParsedToolCall]) -> list[str]:
        """A function_call item is added (arguments "") as a call is announced, its arguments stream as deltas, and
        it is done when the call completes (in ``ended``, by part index; taken out)."""
        events: list[str] = []
        for part in parts:
            if part.name is not None:
                events += self._end_call(ended) + self.close_call() + self.close_text()
                item = {**_call_item(part.name, ""), "status": "in_progress"}
                self.items.append(item)
                self.call = (part.index, item)
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=dict(item)))
            elif self.call is not None and part.index == self.call[0] and part.arguments:
                item = self.call[1]
                item["arguments"] += part.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=part.arguments))
        return events + self._end_call(ended)

    def _end_call(self, ended: dict[int, ParsedToolCall]) -> list[str]:
        if self.call is None or self.call[0] not in ended:
            return []
        (index, item), self.call = self.call, None
        item.update(arguments=ended.pop(index).arguments, status="incomplete" if self.cut else "completed")
        idx = self.items.index(item)
        events = [] if self.cut else [  # no arguments.done after a cut: it says the arguments are whole
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                       arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=idx, item=item)]

    def close_call(self) -> list[str]:
        """The call streaming whose markup did not parse (its text is content next, as in the non-streamed answer)
        is done "incomplete" with the arguments sent; no arguments.done, which says the arguments are whole. (A
        call max_output_tokens cuts off ends through ``_end_call`` with ``cut``: also "incomplete", no text.)"""
        if self.call is None:
            return []
        (_, item), self.call = self.call, None
        item["status"] = "incomplete"
        return [self.event("response.output_item.done", output_index=self.items.index(item), item=item)]

    def write(self, delta: OutputDelta) -> list[str]:
        ended = delta.calls_by_index()
        own, later = delta.split_parts(self.call[0] if self.call is not None else None)
        events = self._call_parts(own, ended)
        events += self.reasoning_delta(delta.reasoning) if delta.reasoning else []
        events += self.text_delta(delta.content) if delta.content else []
        events += self._call_parts(later, ended)
        for call in ended.values():  # a call with no parts (past ``max_calls`` after one that did not parse, or
            # a delta of no parser)
            events += self._call_parts([ToolCallPart(-1, call.name, ""), ToolCallPart(-1, None, call.arguments)],
                                       {-1: call})
        return events


async def _stream(
    ctx: ServingContext,
    req: ResponsesRequest,
    gen: Generation,
    outputs: AsyncIterator[RequestOutput],
    parser_kwargs: dict[str, Any],
) -> AsyncIterator[str]:
    w = _EventWriter()
    created = int(time.time())  # one creation time for every event's response object
    for kind in ("response.created", "response.in_progress"):
        yield w.event(kind, response=_response(ctx, req, gen, [], None, status="in_progress", created_at=created))
    parser, finish = ChatOutputParser(**parser_kwargs), None
    try:
        async for out in outputs:
            for c in out.outputs[:1]:
                w.pending += _logprobs(ctx, req, c.token_ids, c.logprobs)
                deltas = [parser.feed(c.text)]
                if c.finish_reason is not None:  # the end apart: a call it completes was cut off (``w.cut``)
                    finish = c.finish_reason
                    deltas.append(parser.finish(cut_off=finish == "length"))
                for k, delta in enumerate(deltas):
                    w.cut = k == 1 and finish == "length"
                    for event in w.write(delta):
                        yield event
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        error = {k: v for k, v in stream_error_payload(exc)["error"].items() if k != "type"}  # type: "error"
        yield w.event("error", **error)
        return
    for event in w.finish(cut=finish == "length"):
        yield event
    final = _response(ctx, req, gen, w.items, finish, created_at=created,
                      reasoning_tokens=await _reasoning_tokens(ctx, parser.total.reasoning))
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield w.event(kind, response=final)
