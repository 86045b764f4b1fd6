"""Thinking controls of every API as template kwargs and a think-token budget; earlier thinking taken back."""

from __future__ import annotations

import msgspec
import pytest

from kvmem.output_parser import ChatFormat
from kvmem.server import convert
from kvmem.server import messages as M
from kvmem.server import schemas as S
from kvmem.server.responses import input_messages
from kvmem_core.config import KVMemConfig


@pytest.mark.parametrize(
    "effort, kwargs, budget, want",
    [
        (None, None, None, ({}, None)),
        ("low", None, None, ({"reasoning_effort": "low"}, 1024)),
        ("high", None, None, ({"reasoning_effort": "high"}, None)),
        ("none", None, None, ({"reasoning_effort": "none", "enable_thinking": False}, 0)),
        ("none", {"enable_thinking": True}, None, ({"reasoning_effort": "none", "enable_thinking": True}, 0)),
        (None, {"enable_thinking": False}, None, ({"enable_thinking": False}, 0)),
        ("low", None, 50, ({"reasoning_effort": "low"}, 50)),
        (None, {"enable_thinking": False}, 7, ({"enable_thinking": False}, 7)),
    ],
)
def test_effort_switch_and_budget_combine(
    effort: str | None, kwargs: dict | None, budget: int | None, want: tuple[dict, int | None]
) -> None:
    assert convert.thinking(effort, kwargs, budget) == want


def test_a_chat_request_carries_its_budget_and_earlier_thinking() -> None:
    body = msgspec.json.decode(
        msgspec.json.encode(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": "r"},
                    {"role": "user", "content": "q2", "reasoning_content": "ignored"},
                ],
                "reasoning_budget_tokens": 9,
            }
        ),
        type=S.ChatRequest,
    )
    step = convert.chat_step(body, KVMemConfig(), ChatFormat("hermes"))
    assert step.reasoning_budget == 9
    assert [m.get("reasoning_content") for m in step.messages] == [None, "r", None]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            b'{"messages": [{"role": "user", "content": "q"}], "reasoning_budget_tokens": -1}', type=S.ChatRequest
        )


def test_a_responses_reasoning_item_goes_with_the_assistant_turn_after_it() -> None:
    items = msgspec.convert(
        [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "so"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ],
        list[S.InputItem],
    )
    out = input_messages(items)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant"]
    assert out[1]["reasoning_content"] == "hm" and len(out[1]["tool_calls"]) == 2
    assert out[3] == {"role": "assistant", "content": "done", "reasoning_content": "so"}


def test_anthropic_thinking_blocks_and_switch() -> None:
    body = msgspec.convert(
        {
            "max_tokens": 5,
            "thinking": {"type": "disabled"},
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "x"},
                        {"type": "text", "text": "a"},
                    ],
                },
                {"role": "user", "content": "q2"},
            ],
        },
        S.MessagesRequest,
    )
    assert M.chat_messages(body)[1] == {"role": "assistant", "content": "a", "reasoning_content": "hm"}
    assert M.thinking_kwargs(body.thinking) == {"enable_thinking": False}
    assert convert.thinking(None, M.thinking_kwargs(body.thinking), None) == ({"enable_thinking": False}, 0)
    assert M.thinking_kwargs(None) == {}
