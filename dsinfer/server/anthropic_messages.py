"""POST /v1/messages (streaming: message_start … message_stop) and /v1/messages/count_tokens."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.protocol.anthropic_schemas import CountTokensRequest, MessagesRequest
from dsinfer.protocol.chat_encoding import EncodedChat, ends_with_prefill
from dsinfer.protocol.chat_output import ChatOutputParser, OutputDelta, ToolCallPart
from dsinfer.protocol.conversation import anthropic_messages, anthropic_tools
from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.sampling import build_sampling_params
from dsinfer.protocol.structured_request import validate_structured_outputs
from dsinfer.protocol.tool_constraints import (
    ToolSpec,
    forced_tool_names,
    tool_call_constraint,
    with_tool_constraint,
)
from dsinfer.protocol.tool_parsers import ParsedToolCall
from dsinfer.server.context import ServingContext, new_id, parse_body
from dsinfer.server.errors import anthropic_request_id
from dsinfer.server.generation import Generation, primed
from dsinfer.server.sse import SSE_HEADERS, sse_event
from dsinfer.server.streaming_errors import anthropic_stream_error_payload

router = APIRouter()


def _tool_choice_constraint(ctx: ServingContext, req: CountTokensRequest) -> dict[str, Any] | None:
    """``tool_choice`` "any" / "tool" force one call, as OpenAI's "required" / a named function
    (``protocol.tool_constraints``)."""
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool" and not choice.name:
        raise ProtocolError("tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
    tools = [ToolSpec(t.name, t.input_schema) for t in req.tools or []]
    mode = {"any": "required", "tool": "named"}.get(choice.type, choice.type)
    return tool_call_constraint(tools, mode, ctx.tool_parser, choice.name)


def _check_tool_turns(req: CountTokensRequest) -> None:
    """Anthropic's pairing of tool calls and results (400s of its API): the turn after an assistant turn with
    tool_use blocks answers each id with a tool_result, results answer ids of the turn just before, and they lead
    their turn (text after them). Consecutive messages of a role are one turn, as Anthropic joins them."""
    turns: list[tuple[str, list[tuple[str, Any]]]] = []  # (role, [(path, block)])
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            blocks: list[tuple[str, Any]] = [(f"messages.{i}.content", None)]  # text
        else:
            blocks = [(f"messages.{i}.content.{j}", b) for j, b in enumerate(m.content)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    calls: dict[str, str] = {}  # tool_use id -> where it is, of the assistant turn before
    for role, blocks in turns:
        if role == "user":
            answered, other = set(), False
            for path, block in blocks:
                if block is None or block.type != "tool_result":
                    other = True
                    continue
                if block.tool_use_id not in calls:
                    raise ProtocolError(f"{path}: unexpected `tool_use_id` found in `tool_result` blocks: "
                                        f"{block.tool_use_id}. Each `tool_result` block must have a corresponding "
                                        f"`tool_use` block in the previous message.", param=path)
                if other:
                    raise ProtocolError(f"{path}: `tool_result` blocks must come before any other content of their "
                                        f"turn", param=path)
                answered.add(block.tool_use_id)
            unanswered = [tid for tid in calls if tid not in answered]
            if unanswered:
                where = calls[unanswered[0]]
                raise ProtocolError(f"{where}: `tool_use` ids were found without `tool_result` blocks immediately "
                                    f"after: {', '.join(unanswered)}. Each `tool_use` block must have a "
                                    f"corresponding `tool_result` block in the next message.", param=where)
            calls = {}
        else:
            calls = {}
            for path, block in blocks:
                if block is not None and block.type == "tool_use":
                    if block.id in calls:
                        raise ProtocolError(f"{path}: `tool_use` ids must be unique", param=path)
                    calls[block.id] = path.rsplit(".content", 1)[0]


async def _prepare(ctx: ServingContext, req: CountTokensRequest) -> tuple[EncodedChat, bool, dict[str, Any] | None]:
    """The prompt, whether the answer is parsed for tool calls, and the ``tool_choice`` constraint (validated).
    count_tokens goes through this too, so it refuses every request /v1/messages refuses (``max_tokens`` aside,
    which it does not take), with the same error, as Anthropic's count_tokens."""
    choice_is_none = req.tool_choice is not None and req.tool_choice.type == "none"
    tools = anthropic_tools(req) if ctx.prompt_has_tools(req.tools, choice_is_none) else None
    kwargs = {"enable_thinking": req.thinking.type != "disabled"} if req.thinking else None
    messages = anthropic_messages(req)
    _check_tool_turns(req)
    if ends_with_prefill(messages) and messages[-1]["content"] != messages[-1]["content"].rstrip():
        where = f"messages.{len(req.messages) - 1}.content"
        raise ProtocolError(f"{where}: final assistant content cannot end with trailing whitespace", param=where)
    # a final assistant turn with text is a prefill: the answer continues it
    encoded = await ctx.encode_chat(messages, tools, template_kwargs=kwargs,
                                    continue_final_message=ends_with_prefill(messages))
    fmt = req.output_config.format if req.output_config is not None else None
    forced = req.tool_choice is not None and req.tool_choice.type in ("any", "tool")
    constraint, field = with_tool_constraint({"json": fmt.schema_} if fmt else None,
                                             "output_config.format" if fmt else None,
                                             _tool_choice_constraint(ctx, req), forced, "output_config.format")
    await validate_structured_outputs(constraint, field or "tool_choice")
    return encoded, bool(req.tools) and not choice_is_none, constraint


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, CountTokensRequest)
    ctx.check_model(req.model)
    encoded, _, _ = await _prepare(ctx, req)
    return {"input_tokens": len(encoded.token_ids)}


@router.post("/v1/messages")
async def messages(request: Request):
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, MessagesRequest)
    ctx.check_model(req.model)
    encoded, use_tools, constraint = await _prepare(ctx, req)
    fields = dict(
        max_tokens=ctx.max_tokens(req.max_tokens, len(encoded.token_ids)),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        structured_outputs=constraint,
        kv_retention=req.kv_retention,
    )
    if use_tools and ctx.tool_markers_special:
        fields["skip_special_tokens"] = False
    params = build_sampling_params(fields, ctx.vocab_size, req.stream, ctx.sampling_defaults)
    gen = Generation(ctx, encoded.token_ids, params, new_id("msg_"))
    single = req.tool_choice is not None and bool(req.tool_choice.disable_parallel_tool_use)
    choice = req.tool_choice.type if req.tool_choice is not None else "auto"
    forced = forced_tool_names([t.name for t in req.tools or []], {"any": "required", "tool": "named"}.get(
        choice, choice), req.tool_choice.name if req.tool_choice is not None else None)
    parser_kwargs = ctx.output_parser_kwargs(encoded.text, use_tools, parallel_calls=not single, forced_tools=forced)
    if req.stream:
        outputs = await primed(request, gen.outputs())
        return StreamingResponse(
            _stream(ctx, req, gen, outputs, parser_kwargs, anthropic_request_id(request.scope)),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    out = await gen.final(request)
    c = out.outputs[0]
    deltas = _line_deltas(c.text, parser_kwargs, cut_off=_forced_call_cut(c, parser_kwargs))
    content = _blocks(*deltas)
    reason, sequence = _stop_reason(c, req, any(d.tool_calls for d in deltas))
    return JSONResponse(
        {
            "id": gen.request_id,
            "type": "message",
            "role": "assistant",
            "model": ctx.reported_model(req.model),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(gen),
        }
    )


def _usage(gen: Generation, output_tokens: int | None = None) -> dict[str, int]:
    """Anthropic's split of the prompt: ``input_tokens`` are the ones not read from the prefix cache (the three
    input counts add up to the prompt)."""
    return {
        "input_tokens": len(gen.prompt_ids) - gen.num_cached,
        "output_tokens": gen.num_generated if output_tokens is None else output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": gen.num_cached,
    }


def _forced_call_cut(c: Any, parser_kwargs: dict[str, Any]) -> bool:
    """max_tokens cut off a call that ``tool_choice`` forced ("tool" / "any"): it is a tool_use block with the
    input read so far (the output is calls only). Unforced, a call cut short is left as text, its block closed."""
    return c.finish_reason == "length" and bool(parser_kwargs.get("forced_tools"))


def _line_deltas(text: str, parser_kwargs: dict[str, Any], cut_off: bool = False) -> list[OutputDelta]:
    """A whole answer parsed a line at a time, as a stream parses it token by token: each delta says what came
    before what (one parse of the whole text has its content in one piece, text after a tool call included).
    ``cut_off``: ``_forced_call_cut``."""
    parser = ChatOutputParser(**parser_kwargs)
    deltas = [parser.feed(line) for line in text.splitlines(keepends=True)]
    deltas.append(parser.finish(cut_off))
    return deltas


def _blocks(*deltas: OutputDelta) -> list[dict[str, Any]]:
    """The non-streamed content of ``deltas`` (the last one final): the stream's events folded as the SDK's stream
    helper folds them, so that both answers have the same blocks in the same order. A tool_use block whose call
    did not complete is left out: its markup follows as text."""
    writer = _BlockWriter()
    events = [e for k, delta in enumerate(deltas) for e in writer.write(delta, final=k == len(deltas) - 1)]
    blocks: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}  # a tool_use block's input_json_delta text, by block index
    for payload in events + writer.finish():
        if payload["type"] == "content_block_start":
            blocks.append(dict(payload["content_block"]))
        elif payload["type"] == "content_block_delta":
            delta = payload["delta"]
            if delta["type"] == "input_json_delta":
                inputs[payload["index"]] = inputs.get(payload["index"], "") + delta["partial_json"]
            else:  # text_delta / thinking_delta: the field named as the delta's type
                field = delta["type"].removesuffix("_delta")
                blocks[payload["index"]][field] += delta[field]
    for index, text in inputs.items():
        if index not in writer.unfinished:
            blocks[index]["input"] = _input(text)
    return _merged_text([b for k, b in enumerate(blocks) if k not in writer.unfinished])


def _input(text: str) -> dict[str, Any]:
    """A completed call's streamed input. It parses (lone surrogates' escapes are U+FFFD's, ``_ToolInput``), bar
    a call whose parser stopped at a duplicate key after its fragments went out: the SDK's partial parse of those
    is not ours to redo, so its input is empty rather than the request a 500."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _merged_text(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent text blocks as one (those around an unfinished call's block left out)."""
    merged: list[dict[str, Any]] = []
    for block in blocks:
        if merged and block["type"] == merged[-1]["type"] == "text":
            merged[-1]["text"] += block["text"]
        else:
            merged.append(block)
    return merged


def _stop_reason(c: CompletionOutput, req: MessagesRequest, made_calls: bool) -> tuple[str, str | None]:
    if c.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (req.stop_sequences or []):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


# In a call's arguments text (JSON, so backslashes are in strings only): an escaped backslash, or the start of an
# escape of a UTF-16 surrogate, which the SDK's stream helper (jiter) refuses when lone
_SURROGATE_ESCAPE = re.compile(r"\\\\|\\u[dD][89a-fA-F]")
# an escaped backslash, a surrogate pair (group 1, kept: jiter reads it), or a lone surrogate's escape
_LONE_ESCAPE = re.compile(r"\\\\|(\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                          r"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# the end of a text that may be the start of such an escape
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[dD]?)?$")


def _has_surrogate_escape(text: str) -> bool:
    return any(m[0] != "\\\\" for m in _SURROGATE_ESCAPE.finditer(text))


def _lone_escapes_replaced(text: str) -> str:
    """``text`` with each lone surrogate's escape as U+FFFD's, which parses as ``_input`` reads the call."""
    return _LONE_ESCAPE.sub(lambda m: m[0] if m[0] == "\\\\" or m[1] else "\\ufffd", text)


class _ToolInput:
    """The input_json_delta text of a tool_use block: the call's arguments text as its fragments arrive (it parses
    to ``_input``, which the SDK's stream helper reads with a partial JSON parser). Once an escape of a surrogate
    shows up (raw arguments text: DeepSeek's, or Hermes arguments given as a JSON string), nothing more is sent
    until the call completes: the rest goes then, lone surrogates' escapes as U+FFFD's, as ``_input`` has them."""

    def __init__(self, index: int) -> None:
        self.index = index  # the call's ``ToolCallPart.index``
        self.text = ""  # the arguments so far
        self.sent = 0  # how much of ``text`` was sent
        self.held = False  # a surrogate's escape came: the rest waits for the completed call

    def feed(self, fragment: str) -> str:
        self.text += fragment
        self.held = self.held or _has_surrogate_escape(self.text)
        if self.held:
            return ""
        # an escape's start is held back: it may turn out a surrogate's
        partial = _PARTIAL_ESCAPE.search(self.text)
        end = partial.start() if partial else len(self.text)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def rest(self, call: ParsedToolCall) -> str:
        """What is left to send of the completed ``call``'s input."""
        text = _lone_escapes_replaced(call.arguments)
        sent = self.text[: self.sent]
        # the parts add up to the arguments (``ChatOutputParser``), bar a duplicate key that the parser stops at
        return text[len(sent) :] if text.startswith(sent) else ""


class _BlockWriter:
    """Opens, fills and closes content blocks as reasoning/text/tool calls arrive: event payloads, which the stream
    sends as SSE events named by their type and the non-streamed answer folds into its blocks (``_blocks``)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.call: _ToolInput | None = None  # the tool_use block open, while its call streams
        # whitespace that came before any text block: it opens none by itself (a tool call may follow, as the
        # non-streamed answer, which drops whitespace-only text beside tool calls), but leads the text if it comes
        self.pending_space = ""
        self.unfinished: list[int] = []  # the tool_use blocks closed before their call completed

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict[str, Any]]:
        """Closes the open block. A call's block still open closes as it is: its call did not complete (markup
        that does not parse, or cut off), which its text, content now, follows as the non-streamed answer has it."""
        if self.call is not None:
            self.unfinished.append(self.index)
        self.call = None
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def open_only_text(self) -> list[dict[str, Any]]:
        """The text block of an answer with no other block: empty, or the whitespace held back."""
        events = self._start("text", {"type": "text", "text": ""})
        if self.pending_space:
            events.append(self._delta({"type": "text_delta", "text": self.pending_space}))
            self.pending_space = ""
        return events

    def _input_delta(self, partial: str) -> list[dict[str, Any]]:
        return [self._delta({"type": "input_json_delta", "partial_json": partial})] if partial else []

    def _call_parts(self, parts: list[ToolCallPart], ended: dict[int, ParsedToolCall]) -> list[dict[str, Any]]:
        """The tool_use blocks of ``parts``: one opens as a call is announced, and closes when the call completes
        (in ``ended``, by index; taken out) with the rest of its input."""
        events: list[dict[str, Any]] = []
        for part in parts:
            if part.name is not None:
                events += self._end_call(ended)
                block = {"type": "tool_use", "id": new_id("toolu_")[:30], "name": part.name, "input": {}}
                events += self._start("tool_use", block)
                self.call = _ToolInput(part.index)
            elif self.call is not None and part.index == self.call.index:
                events += self._input_delta(self.call.feed(part.arguments))
        return events + self._end_call(ended)

    def _end_call(self, ended: dict[int, ParsedToolCall]) -> list[dict[str, Any]]:
        if self.call is None or self.call.index not in ended:
            return []
        call, self.call = self.call, None  # completed: its block is not closed unfinished
        return self._input_delta(call.rest(ended.pop(call.index))) + self.close()

    def write(self, delta: OutputDelta, final: bool = False) -> list[dict[str, Any]]:
        """The events of ``delta``; ``final``: the generation's last, where a call announced and not completed
        never will be (its markup is this delta's content): it opens no block."""
        ended = delta.calls_by_index()
        own, later = delta.split_parts(self.call.index if self.call is not None else None)
        if final:
            later = [p for p in later if p.index in ended]
        events = self._call_parts(own, ended)
        if delta.reasoning:
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content and self.open != "text" and not delta.content.strip():
            self.pending_space += delta.content
        elif delta.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": self.pending_space + delta.content}))
            self.pending_space = ""
        events += self._call_parts(later, ended)
        for call in ended.values():  # a call with no parts (past ``max_calls`` after one that did not parse, or
            # a delta of no parser)
            block = {"type": "tool_use", "id": new_id("toolu_")[:30], "name": call.name, "input": {}}
            events += self._start("tool_use", block)
            events += self._input_delta(_lone_escapes_replaced(call.arguments)) + self.close()
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The end of the answer: one text block if none opened (empty, or the whitespace held back), as
        Anthropic's answers have at least one block; the open block closed."""
        return (self.open_only_text() if self.index < 0 else []) + self.close()


async def _stream(
    ctx: ServingContext,
    req: MessagesRequest,
    gen: Generation,
    outputs: AsyncIterator[RequestOutput],
    parser_kwargs: dict[str, Any],
    request_id: str | None = None,
) -> AsyncIterator[str]:
    message = {
        "id": gen.request_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.reported_model(req.model),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(gen, output_tokens=0),
    }
    yield sse_event("message_start", {"type": "message_start", "message": message})
    yield sse_event("ping", {"type": "ping"})
    parser, writer = ChatOutputParser(**parser_kwargs), _BlockWriter()
    made_calls, last = False, None
    try:
        async for out in outputs:
            c = last = out.outputs[0] if out.outputs else last
            if c is None:
                continue
            delta = parser.feed(c.text)
            if c.finish_reason is not None:
                delta.extend(parser.finish(cut_off=_forced_call_cut(c, parser_kwargs)))
            made_calls |= bool(delta.tool_calls)
            for event in writer.write(delta, final=c.finish_reason is not None):
                yield sse_event(event["type"], event)
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_event("error", anthropic_stream_error_payload(exc, request_id))
        return
    for event in writer.finish():
        yield sse_event(event["type"], event)
    reason, sequence = _stop_reason(last, req, made_calls) if last is not None else ("end_turn", None)
    yield sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": gen.num_generated},
        },
    )
    yield sse_event("message_stop", {"type": "message_stop"})
