"""The Anthropic Messages subset: blocks -> chat turns, usage split, error shape."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from kvmem.output_parser import Parsed
from kvmem.server import messages as M
from kvmem.server import schemas as S
from kvmem.server.errors import APIError, to_api_error
from kvmem_core.contract import StepResult
from kvmem_core.errors import BudgetError


def body(**fields: object) -> S.MessagesRequest:
    return msgspec.json.decode(json.dumps({"model": "m", "max_tokens": 5, **fields}), type=S.MessagesRequest)


def test_blocks_become_chat_turns_with_tool_calls_and_results() -> None:
    req = body(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3 C"}]},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    )
    assert M.chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.mark.parametrize(
    "content", [[{"type": "image", "source": {}}], [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]]
)
def test_unsupported_blocks_are_400(content: list[dict[str, object]]) -> None:
    with pytest.raises(APIError) as info:
        M.chat_messages(body(messages=[{"role": "user", "content": content}]))
    assert info.value.status == 400 and info.value.param == "messages[0].content[0]"


def test_tools_map_to_chat_tools_and_none_drops_them() -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    assert M.chat_tools(body(messages=[{"role": "user", "content": "x"}], tools=tools)) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert (
        M.chat_tools(body(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice={"type": "none"}))
        is None
    )


def test_usage_splits_cache_reads_from_input_tokens() -> None:
    result = StepResult("hi", (1, 2), "length", 40, 30, "w")
    assert M.usage(result) == {
        "input_tokens": 10,
        "output_tokens": 2,
        "cache_read_input_tokens": 30,
        "cache_creation_input_tokens": 0,
    }


def test_tool_calls_become_tool_use_blocks() -> None:
    calls = [{"id": "call_ab", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert M.content_blocks(Parsed(calls=calls)) == [
        {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {"a": 1}}
    ]
    assert M.content_blocks(Parsed()) == [{"type": "text", "text": ""}]
    assert M.content_blocks(Parsed("hm", "hi")) == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "text", "text": "hi"},
    ]


def test_errors_take_the_anthropic_shape() -> None:
    assert M.anthropic_error(to_api_error(BudgetError("spans"))) == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "spans", "code": "budget_exceeded"},
    }
    assert M.anthropic_error(APIError(503, "later", "engine_unavailable"))["error"]["type"] == "overloaded_error"


def stream_blocks(items: list) -> list[tuple]:
    """The Messages stream events ``Blocks`` sends for parser items, as (type, index, what) tuples."""
    sent: list[tuple] = []

    async def send(kind: str, index: int, **fields: object) -> None:
        what = fields.get("content_block") or fields.get("delta") or {}
        sent.append((kind, index, what.get("type")))

    async def go() -> None:
        blocks = M.Blocks(send)
        for item in items:
            await blocks.write(item)
        await blocks.close()

    asyncio.run(go())
    return sent


def test_streamed_blocks_open_by_kind_and_an_answer_always_has_text_or_a_tool_use() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert stream_blocks([("reasoning", "hm"), ("reasoning", "m"), ("content", "hi"), ("call", call)]) == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
    ]
    assert [e[2] for e in stream_blocks([("reasoning", "hm")]) if e[0] == "content_block_start"] == ["thinking", "text"]
    assert [e[2] for e in stream_blocks([("call", call)]) if e[0] == "content_block_start"] == ["tool_use"]
