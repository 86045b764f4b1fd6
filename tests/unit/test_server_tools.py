"""The plain-text tool-call format: rendering transcripts, parsing calls, streaming around them."""
from __future__ import annotations

import json

import pytest

from kvmem import tools_format as T

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_render_plain_rewrites_an_agent_transcript() -> None:
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    out = T.render_plain(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("You help.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_render_plain_adds_a_system_turn_for_tools_when_there_is_none() -> None:
    out = T.render_plain([{"role": "user", "content": "hi"}], TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"] == T.tools_text(TOOLS)
    assert T.render_plain([{"role": "user", "content": "hi"}], None) == [{"role": "user", "content": "hi"}]


def test_parse_reads_back_what_render_writes() -> None:
    text = "Let me check.\n" + T.call_text("get_weather", '{"city": "Oslo"}') + "\n" + T.call_text("get_time", "{}")
    content, calls = T.parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                  "<tool_call>[1, 2]</tool_call>"])
def test_text_without_a_valid_call_stays_content(text: str) -> None:
    assert T.parse_tool_calls(text) == (text, [])


def test_unclosed_call_at_the_end_still_parses() -> None:
    _, calls = T.parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_stream_filter_holds_back_a_call_split_across_pieces() -> None:
    f = T.ToolCallFilter()
    pieces = ["Sure", ". <tool", "_ca", 'll>{"name": "f", ', '"arguments": {}}</tool_call>']
    streamed = "".join(f.feed(p) for p in pieces)
    rest, calls = f.finish()
    assert streamed == "Sure. "
    assert rest == "" and calls[0]["function"]["name"] == "f"


def test_stream_filter_releases_a_false_alarm() -> None:
    f = T.ToolCallFilter()
    assert f.feed("a <to") == "a "
    assert f.feed("p> b") == "<top> b"
    assert f.finish() == ("", [])


def test_stream_filter_returns_held_text_that_was_no_call() -> None:
    f = T.ToolCallFilter()
    assert f.feed("x <tool_call> oops") == "x "
    assert f.finish() == ("<tool_call> oops", [])
