"""``kvmem.pin``, ``kvmem.groups`` and ``kvmem.relevance`` in requests: the engine's message indexes, and every bad
value a 400 with the OpenAI error JSON before the engine is needed."""

from __future__ import annotations

import json
from typing import Iterator

import msgspec
import pytest
from serving import AppClient, error_of as error

from kvmem.output_parser import ChatFormat
from kvmem.server import convert
from kvmem.server import schemas as S
from kvmem.server.errors import to_api_error
from kvmem_core.config import KVMemConfig

CONFIG = KVMemConfig()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TURNS = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Checking."},
    {"role": "user", "content": "Thanks."},
]


def chat(**fields: object) -> S.ChatRequest:
    return msgspec.json.decode(json.dumps({"model": "m", "messages": TURNS, **fields}), type=S.ChatRequest)


def test_pins_and_groups_become_overrides() -> None:
    step = convert.chat_step(
        chat(kvmem={"pin": [2, 0], "groups": False, "relevance": 0.5}), CONFIG, ChatFormat(tools="hermes")
    )
    assert step.overrides == {"groups": False, "relevance": 0.5, "pin": (2, 0)}


def test_pins_follow_their_messages_behind_a_tools_turn_the_server_adds() -> None:
    step = convert.chat_step(chat(kvmem={"pin": [0, 2]}, tools=TOOLS), CONFIG, ChatFormat())
    assert step.messages[0]["role"] == "system"  # the tool definitions, as text for a template without tools
    assert step.overrides["pin"] == (1, 3)
    assert [step.messages[i]["content"] for i in step.overrides["pin"]] == ["Weather?", "Thanks."]


def test_a_pin_past_the_messages_is_400() -> None:
    with pytest.raises(Exception) as info:
        convert.chat_step(chat(kvmem={"pin": [1, 3]}, tools=TOOLS), CONFIG, ChatFormat())
    err = to_api_error(info.value)
    assert (err.status, err.param, err.code, err.type) == (
        400,
        "kvmem.pin",
        "invalid_kvmem_options",
        "invalid_request_error",
    )
    assert "[3]" in err.message and "has 3" in err.message


@pytest.fixture(scope="module")
def client() -> Iterator[AppClient]:
    c = AppClient()
    yield c
    c.close()


@pytest.mark.parametrize(
    "kvmem, param",
    [
        ({"pin": ["a"]}, "kvmem.pin[0]"),
        ({"pin": [1.5]}, "kvmem.pin[0]"),
        ({"pin": [-1]}, "kvmem.pin[0]"),
        ({"pin": 2}, "kvmem.pin"),
        ({"pin": [0, 7]}, "kvmem.pin"),
        ({"groups": "no"}, "kvmem.groups"),
        ({"relevance": 1.5}, "kvmem.relevance"),
        ({"relevance": "high"}, "kvmem.relevance"),
    ],
)
def test_bad_pins_and_groups_are_400_before_the_engine(client: AppClient, kvmem: dict[str, object], param: str) -> None:
    status, _, body = client.request(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": TURNS, "kvmem": kvmem}
    )
    err = error(body)
    assert (status, err["type"], err["param"]) == (400, "invalid_request_error", param)


def test_a_raw_prompt_has_no_messages_to_pin(client: AppClient) -> None:
    status, _, body = client.request(
        "POST", "/v1/completions", json={"model": "m", "prompt": "Hi", "kvmem": {"pin": [0]}}
    )
    err = error(body)
    assert (status, err["code"]) == (400, "invalid_kvmem_options") and "a raw prompt has none" in err["message"]
