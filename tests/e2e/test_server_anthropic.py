"""The Anthropic Messages subset end to end through the official ``anthropic`` client."""

from __future__ import annotations

from typing import Iterator

import pytest
from serving import LiveServer

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.llamacpp
GREEDY = {"extra_body": {"temperature": 0}}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    live = LiveServer(tmp_path_factory.mktemp("anthropic"), "--no-ui", "--api-key", "k").start()
    yield anthropic.Anthropic(base_url=live.url, api_key="k", max_retries=0)
    live.stop()


def test_create_then_stream_a_second_turn_with_cache_reads(client: anthropic.Anthropic) -> None:
    turn1 = [{"role": "user", "content": "Name a planet."}]
    first = client.messages.create(model="", max_tokens=6, system="Be brief.", messages=turn1, **GREEDY)
    assert (
        first.type == "message" and first.content[0].type == "text" and first.stop_reason in ("end_turn", "max_tokens")
    )
    counted = client.messages.count_tokens(model="", system="Be brief.", messages=turn1)
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    turn2 = turn1 + [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Another?"}]
    with client.messages.stream(model="", max_tokens=6, system="Be brief.", messages=turn2, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text
    assert final.usage.cache_read_input_tokens > 0 and final.usage.output_tokens > 0


def test_tool_use_and_tool_result_blocks(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(
        model="",
        max_tokens=6,
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"}]},
        ],
        **GREEDY,
    )
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_errors_use_the_anthropic_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=client.base_url, api_key="wrong", max_retries=0).messages.create(
            model="", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
