"""Streamed chat tool calls arrive in pieces, as vLLM and OpenAI send them: a first chunk with the call's index, id,
type and name (arguments ""), then chunks with the index and an arguments fragment only; the fragments add up to the
non-streamed answer's arguments. Fed token-sized pieces through the chat route (Hermes and both DeepSeek formats),
and against the live server with the openai SDK."""

from __future__ import annotations

import asyncio
import json

import pytest

from dsinfer.protocol.chat_output import parse_output
from dsinfer.protocol.openai_schemas import ChatCompletionRequest
from dsinfer.protocol.tool_parsers import DeepSeekV3ToolParser, HermesToolParser
from dsinfer.server import openai_chat

from .fake_generation import fake_stream
from .weather_tools import ASK, CHAT_TOOLS, MODEL

ARGS = [{"city": "Paris", "days": [1, 2.50, -0], "note": 'say "hi"\\n \u00e9\U0001F600', "metric": True},
        {"city": "Rome", "nested": {"a": None, "b": {}}}]


def _hermes(args: dict) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>'


def _ds_v3(args: dict) -> str:
    body = f"function<｜tool▁sep｜>get_weather\n```json\n{json.dumps(args, indent=1)}\n```"
    return f"<｜tool▁call▁begin｜>{body}<｜tool▁call▁end｜>"


def _ds_v31(args: dict) -> str:
    return f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


FORMATS = {
    "hermes": (HermesToolParser, "\n".join(_hermes(a) for a in ARGS)),
    "deepseek_v3": (DeepSeekV3ToolParser,
                    "<｜tool▁calls▁begin｜>" + "\n".join(_ds_v3(a) for a in ARGS) + "<｜tool▁calls▁end｜>"),
    "deepseek_v31": (DeepSeekV3ToolParser,
                     "<｜tool▁calls▁begin｜>" + "".join(_ds_v31(a) for a in ARGS) + "<｜tool▁calls▁end｜>"),
}


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _chunks(pieces: list[str], parser, parallel: bool = True, finish: str | None = None) -> list[dict]:
    """The chat route's streamed chunks for a generation arriving in ``pieces`` (a server with ``parser``),
    finished with ``finish`` where given."""

    async def collect() -> list[str]:
        ctx, gen, outputs = fake_stream(pieces, "chatcmpl-1", MODEL)
        req = ChatCompletionRequest(model=MODEL, messages=ASK, tools=CHAT_TOOLS, stream=True,
                                    parallel_tool_calls=parallel)
        kwargs = {"tool_parser": parser, "max_calls": None if parallel else 1}

        async def finished_with():
            async for out in outputs:
                if out.finished and finish is not None:
                    for c in out.outputs:
                        c.finish_reason = finish
                yield out

        return [e async for e in openai_chat._stream(ctx, req, gen, finished_with(), kwargs)]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def _calls_by_index(chunks: list[dict]) -> dict[int, list[dict]]:
    calls: dict[int, list[dict]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        for tc in choice["delta"].get("tool_calls", []):
            calls.setdefault(tc["index"], []).append(tc)
    return calls


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_calls_stream_in_pieces_that_add_up_to_the_answer(fmt, size):
    parser, calls_text = FORMATS[fmt]
    text = "Let me check. " + calls_text
    chunks = _chunks(_pieces(text, size), parser)
    full = parse_output(text, tool_parser=parser)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == full.content == "Let me check. "
    # the text is sent before the first call is announced
    first_call = next(k for k, c in enumerate(chunks) if c["choices"][0]["delta"].get("tool_calls"))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:first_call]) == "Let me check. "
    calls = _calls_by_index(chunks)
    assert sorted(calls) == [0, 1]
    for index, (head, *fragments) in calls.items():
        assert head["id"].startswith("call_") and head["type"] == "function"
        assert head["function"] == {"name": "get_weather", "arguments": ""}
        assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
        arguments = "".join(f["function"]["arguments"] for f in fragments)
        assert arguments == full.tool_calls[index].arguments  # the same text, not only the same JSON
        assert json.loads(arguments) == json.loads(json.dumps(ARGS[index]))
        if size == 1:  # in pieces: the arguments arrive over many chunks, not once the call is complete
            assert len(fragments) > 10
    for chunk in chunks[1:]:  # one tool call per chunk, as vLLM
        assert len(chunk["choices"][0]["delta"].get("tool_calls", [])) <= 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_parallel_tool_calls_false_streams_the_first_call_only(fmt):
    parser, calls_text = FORMATS[fmt]
    calls = _calls_by_index(_chunks(_pieces(calls_text, 2), parser, parallel=False))
    assert sorted(calls) == [0]
    assert json.loads("".join(f["function"]["arguments"] for f in calls[0][1:])) == ARGS[0]


def test_a_call_read_whole_in_one_piece_is_announced_then_sent():
    chunks = _chunks(["Hi", _hermes(ARGS[1])], HermesToolParser)
    (head, rest) = _calls_by_index(chunks)[0]
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(rest["function"]["arguments"]) == ARGS[1] and "id" not in rest


def test_a_call_cut_off_sends_no_more_and_its_text_is_content():
    """Announced once its name is read, a call whose markup never ends (max_tokens) stops there: the answer has
    its text as content, as the non-streamed answer, and finishes as it would without a call."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    chunks = _chunks(_pieces(text, 4), HermesToolParser)
    (head, *fragments) = _calls_by_index(chunks)[0]
    assert head["function"]["name"] == "get_weather"
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Par'
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("text, content", [
    ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
     "Let me check. "),
    ('\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n', None),
])
def test_non_streamed_content_beside_calls_is_the_streamed_text(text, content):
    """The text around the calls keeps its whitespace, as the stream sends it (and vLLM answers); blank: null."""
    from dsinfer.engine.outputs import CompletionOutput, RequestOutput

    ctx, gen, _ = fake_stream([text], "chatcmpl-1", MODEL)
    gen.usage = lambda: {}
    req = ChatCompletionRequest(model=MODEL, messages=ASK, tools=CHAT_TOOLS)
    out = RequestOutput("r", None, [1], None, [CompletionOutput(0, text, [1], finish_reason="stop")], True)
    (choice,) = openai_chat._response(ctx, req, gen, out, {"tool_parser": HermesToolParser})["choices"]
    assert choice["message"]["content"] == content and choice["finish_reason"] == "tool_calls"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in _chunks(_pieces(text, 5),
                                                                                      HermesToolParser))
    assert streamed.strip() == (content or "").strip() and (content is None or streamed == content)


@pytest.mark.parametrize("pieces", [4, 7])
def test_a_call_max_tokens_cuts_off_is_a_call_with_the_arguments_read(pieces):
    """As OpenAI answers it: finish reason "length", the call with its arguments so far, streamed or not, and its
    markup not repeated as content."""
    lead = "Let me check. "
    text = lead + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2'
    chunks = _chunks(_pieces(text, pieces), HermesToolParser, finish="length")
    (head, *fragments) = _calls_by_index(chunks)[0]
    streamed = "".join(f["function"]["arguments"] for f in fragments)
    assert head["function"]["name"] == "get_weather" and streamed.startswith('{"city": "Paris", "days": [1')
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == lead
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = parse_output(text, True, tool_parser=HermesToolParser)
    assert whole.content == lead and [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", streamed)]
    assert parse_output(text, tool_parser=HermesToolParser).content == text  # ended otherwise: no call was made


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"s": "\\ud83d\\ude00 \\ud800 \\ud800x \\u00e9\\t\\\\\\"/\\/", "n": [1E2, -0.0, 7]}}',
    '{"arguments": {"a": [[], [{}], "x"]}, "name": "f"}',
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',
    '{"name": "f", "parameters": {"a": 1}}',
    '{"name": "f", "arguments": {"a": "</tool_c", "b": 2}}',
])
def test_hermes_fragments_are_prefixes_of_the_final_arguments(body):
    """Character by character: escapes decoded and re-encoded, surrogates (paired or lone), numbers as json.dumps
    writes them, arguments as a JSON string or under "parameters" (sent whole at the end), a marker's prefix in a
    string."""
    text = f"<tool_call>{body}</tool_call>"
    calls = _calls_by_index(_chunks(list(text), HermesToolParser))
    (head, *fragments) = calls[0]
    assert head["function"]["name"] == "f"
    assert "".join(f["function"]["arguments"] for f in fragments) == parse_output(
        text, tool_parser=HermesToolParser).tool_calls[0].arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_live_forced_call_streams_its_arguments_in_pieces(client, choice):
    """The forced call (constrained Hermes JSON) is announced, then its arguments come in several fragments that
    the SDK's stream helper adds up to the non-streamed call."""
    kwargs = dict(model=MODEL, messages=ASK, tools=CHAT_TOOLS, tool_choice=choice, temperature=0, max_tokens=60)
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [tc for e in stream if e.type == "chunk" for c in e.chunk.choices for tc in c.delta.tool_calls or []]
        final = stream.get_final_completion().choices[0].message.tool_calls[0]
    head, *fragments = deltas
    assert head.id == final.id and head.function.name == "get_weather" and head.function.arguments == ""
    assert len(fragments) > 2 and all(d.id is None and d.function.name is None for d in fragments)
    assert "".join(d.function.arguments for d in fragments) == final.function.arguments == full.function.arguments
