from __future__ import annotations

from dsinfer.protocol.chat_output import ChatOutputParser, parse_output
from dsinfer.protocol.reasoning import ReasoningParser
from dsinfer.protocol.tool_parsers import DeepSeekV3ToolParser, HermesToolParser, ParsedToolCall

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
)
DEEPSEEK = (
    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
    '{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
CALLS = [ParsedToolCall("get_weather", '{"city": "Paris"}'), ParsedToolCall("get_time", '{"tz": "CET"}')]


def _stream(parser_cls, text, step=1):
    parser = parser_cls()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = parser.feed(text[i : i + step])
        content += c
        calls += k
    c, k = parser.finish()
    return content + c, calls + k


def test_hermes_tool_calls_whole_and_streamed():
    for step in (len(HERMES), 1, 3, 7):
        assert _stream(HermesToolParser, HERMES, step) == ("Let me check. ", CALLS)


def test_deepseek_v3_tool_calls_whole_and_streamed():
    for step in (len(DEEPSEEK), 1, 5):
        assert _stream(DeepSeekV3ToolParser, DEEPSEEK, step) == ("Sure.", CALLS)


def test_deepseek_v31_format():
    text = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert _stream(DeepSeekV3ToolParser, text) == ("", [CALLS[1]])


def test_malformed_tool_call_is_returned_as_content():
    text = "a <tool_call>{not json}</tool_call> b"
    assert _stream(HermesToolParser, text, 2) == (text, [])


def test_unfinished_tool_call_is_flushed_as_content():
    text = 'x <tool_call>{"name": "f"'
    assert _stream(HermesToolParser, text, 4) == (text, [])


def test_lone_surrogate_escapes_in_a_call_become_replacement_characters():
    """A model may write ``\\ud800`` alone: the call must still encode to UTF-8 (U+FFFD, as request bodies)."""
    text = '<tool_call>{"name": "f\\udc00", "arguments": {"city\\ud800": "Par\\ud800is"}}</tool_call>'
    _, calls = _stream(HermesToolParser, text)
    assert calls == [ParsedToolCall("f\ufffd", '{"city\ufffd": "Par\ufffdis"}')]
    calls[0].arguments.encode()


def test_text_without_tool_calls_passes_through_and_holds_back_only_a_marker_prefix():
    parser = HermesToolParser()
    assert parser.feed("hello <tool") == ("hello ", [])
    assert parser.feed("s are fun") == ("<tools are fun", [])


def test_reasoning_whole_and_streamed():
    text = "<think>\nstep 1, step 2\n</think>\n\nThe answer is 4."
    for step in (len(text), 1, 4):
        parser, reasoning, content = ReasoningParser(), "", ""
        for i in range(0, len(text), step):
            r, c = parser.feed(text[i : i + step])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == ("\nstep 1, step 2\n", "The answer is 4.")


def test_reasoning_when_prompt_opened_the_block_and_when_absent():
    assert parse_output("plan</think>done", reasoning=True, in_reasoning=True).reasoning == "plan"
    out = parse_output("no thinking here", reasoning=True)
    assert (out.reasoning, out.content) == ("", "no thinking here")


def test_reasoning_then_tool_call():
    parser = ChatOutputParser(reasoning=True, tool_parser=HermesToolParser)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<think>need weather</think><tool_call>{call}</tool_call>"
    for ch in text:
        parser.feed(ch)
    parser.finish()
    assert parser.total.reasoning == "need weather"
    assert parser.total.content == ""
    assert parser.total.tool_calls == CALLS[:1]
