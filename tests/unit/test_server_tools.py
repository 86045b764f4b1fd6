"""Transcripts for templates: tools as plain text where the template has none, argument objects where it has."""

from __future__ import annotations

import json

from kvmem import tools_format as T
from kvmem.output_parser import ChatFormat, parse_output

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_render_plain_rewrites_an_agent_transcript() -> None:
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    out = T.render_plain(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("You help.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"
    assert [set(m) - {"role", "content"} for m in out] == [set(), set(), set(), {"tool_call_id"}]
    assert out[3]["tool_call_id"] == "call_1"  # the result stays grouped with its call (kvmem_core.groups)


def test_render_plain_adds_a_system_turn_for_tools_when_there_is_none() -> None:
    out = T.render_plain([{"role": "user", "content": "hi"}], TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"] == T.tools_text(TOOLS)
    assert T.render_plain([{"role": "user", "content": "hi"}], None) == [{"role": "user", "content": "hi"}]


def test_parse_reads_back_what_render_writes() -> None:
    text = "Let me check.\n" + T.call_text("get_weather", '{"city": "Oslo"}') + "\n" + T.call_text("get_time", "{}")
    out = parse_output(text, ChatFormat().parser(with_tools=True))
    assert out.content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in out.calls)


def test_native_messages_give_templates_argument_objects() -> None:
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    out = T.native_messages(messages, "hermes")
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and out[1]["tool_call_id"] == "call_1"
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's list is left alone
    odd = T.native_messages(
        [
            {
                **messages[0],
                "tool_calls": [{"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
            }
        ],
        "hermes",
    )
    assert odd[0]["tool_calls"][0]["function"]["arguments"] == "{oops"


def test_mistral_templates_get_nine_character_ids_that_repeat() -> None:
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    first, again = T.native_messages(messages, "mistral"), T.native_messages(messages, "mistral")
    call_id = first[0]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and first[1]["tool_call_id"] == call_id
    assert again == first
    assert (
        T.native_messages([{"role": "tool", "tool_call_id": "abcDEF123", "content": "x"}], "mistral")[0]["tool_call_id"]
        == "abcDEF123"
    )
