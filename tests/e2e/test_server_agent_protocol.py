"""The protocol details agent frameworks act on, on a live server, every body and stream event validated against
the openai SDK's types: a tool call cut by ``max_tokens`` finishes with ``length``, usage carries every field the
SDK requires, an answer without ``max_tokens`` may use the room left in the workspace, a chain that ends in an
unanswered call is a 400, and a call to a tool the request did not offer is not a tool call.

The small test model calls tools after a transcript in which it called them before (``few_shot``)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from sdk_types import create, post, stream
from serving import LiveServer

pytestmark = pytest.mark.llamacpp
GREEDY: dict[str, Any] = {"model": "", "temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER},
    }
]
CITIES = ("Paris", "Rome", "Lima")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    live = LiveServer(tmp_path_factory.mktemp("agent"), "--no-ui", "--ctx", "4096").start()
    yield live.url
    live.stop()


def call(i: int, city: str) -> dict[str, Any]:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def few_shot() -> list[dict[str, Any]]:
    """A chat transcript in which every question got a call and its result, then a new question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You call tools. Always answer with a tool call."}]
    for i, city in enumerate(CITIES):
        messages += [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call(i, city)]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"},
        ]
    return messages + [{"role": "user", "content": "Weather in Oslo?"}]


def few_shot_items() -> list[dict[str, Any]]:
    """``few_shot`` as Responses input items."""
    items: list[dict[str, Any]] = [{"role": "system", "content": "You call tools. Always answer with a tool call."}]
    for i, city in enumerate(CITIES):
        items += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "type": "function_call",
                "call_id": f"call_{i}",
                "name": "get_weather",
                "arguments": json.dumps({"city": city}),
            },
            {"type": "function_call_output", "call_id": f"call_{i}", "output": "sunny"},
        ]
    return items + [{"role": "user", "content": "Weather in Oslo?"}]


def few_shot_anthropic() -> dict[str, Any]:
    """``few_shot`` as a Messages body (without ``max_tokens``)."""
    messages: list[dict[str, Any]] = []
    for i, city in enumerate(CITIES):
        messages += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"call_{i}", "name": "get_weather", "input": {"city": city}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"call_{i}", "content": "sunny"}]},
        ]
    messages[-1]["content"].append({"type": "text", "text": "Weather in Oslo?"})
    return {
        "model": "",
        "temperature": 0,
        "system": "You call tools. Always answer with a tool call.",
        "messages": messages,
        "tools": [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}],
    }


def longest_cut_call(api: str, body: dict[str, Any], tokens: int) -> tuple[int, Any]:
    """The largest ``max_tokens`` under an answer's ``tokens`` whose reply still reads as a tool call (the
    arguments complete, the closing tag cut), with that reply."""
    for limit in range(tokens - 1, 0, -1):
        reply = create(api, "/v1/chat/completions", {**body, "max_tokens": limit})
        if reply.choices[0].message.tool_calls:
            return limit, reply
    raise AssertionError("no cut of the answer reads as a call")


def test_a_tool_call_cut_by_max_tokens_finishes_with_length(api: str) -> None:
    body = {**GREEDY, "messages": few_shot(), "tools": TOOLS}
    whole = create(api, "/v1/chat/completions", {**body, "max_tokens": 80})
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.tool_calls
    limit, cut = longest_cut_call(api, body, whole.usage.completion_tokens)
    assert cut.choices[0].finish_reason == "length"
    chunks = stream(api, "/v1/chat/completions", {**body, "max_tokens": limit})
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    anthropic = few_shot_anthropic()
    assert post(api, "/v1/messages", {**anthropic, "max_tokens": 80}).json()["stop_reason"] == "tool_use"
    cut_short = post(api, "/v1/messages", {**anthropic, "max_tokens": limit}).json()
    assert [b["type"] for b in cut_short["content"]] == ["tool_use"] and cut_short["stop_reason"] == "max_tokens"


def test_usage_has_every_field_the_sdk_requires(api: str) -> None:
    ask = {**GREEDY, "input": "Name one planet.", "max_output_tokens": 6}
    first = create(api, "/v1/responses", ask)
    again = create(api, "/v1/responses", ask)
    details = again.usage.input_tokens_details
    assert details.cached_tokens > 0 and details.cache_write_tokens == again.usage.input_tokens - details.cached_tokens
    assert first.usage.input_tokens_details.cache_write_tokens > details.cache_write_tokens
    events = stream(api, "/v1/responses", ask)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"  # OpenAI's event
    assert events[-1].response.usage.input_tokens_details.cache_write_tokens >= 0
    chat = create(
        api,
        "/v1/chat/completions",
        {**GREEDY, "messages": [{"role": "user", "content": "Name one planet."}], "max_tokens": 6},
    )
    usage = chat.usage
    assert (
        usage.prompt_tokens_details.cache_write_tokens
        == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    )


def test_without_max_tokens_an_answer_may_pass_the_old_256_token_default(api: str) -> None:
    counting = {**GREEDY, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", "stop": [" 80,"]}  # about 280 tokens
    done = create(api, "/v1/completions", counting)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens > 256
    assert done.choices[0].text.endswith(" 79,")


def test_a_chain_that_ends_in_an_unanswered_call_is_a_400(api: str) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    first = create(api, "/v1/responses", {**GREEDY, "input": few_shot_items(), "tools": tools, "max_output_tokens": 80})
    (called,) = [item for item in first.output if item.type == "function_call"]
    dangling = post(
        api,
        "/v1/responses",
        {**GREEDY, "input": "Thanks!", "previous_response_id": first.id, "tools": tools, "max_output_tokens": 4},
    )
    assert dangling.status_code == 400
    error = dangling.json()["error"]
    assert error["message"] == f"No tool output found for function call {called.call_id}." and error["param"] == "input"
    answered = [{"type": "function_call_output", "call_id": called.call_id, "output": "sunny"}]
    assert create(
        api,
        "/v1/responses",
        {**GREEDY, "input": answered, "previous_response_id": first.id, "tools": tools, "max_output_tokens": 4},
    ).status in ("completed", "incomplete")
    unanswered = few_shot_items()[:-2] + [{"role": "user", "content": "Weather in Oslo?"}]
    assert post(api, "/v1/responses", {**GREEDY, "input": unanswered, "max_output_tokens": 4}).status_code == 400


def test_a_call_to_a_tool_the_request_did_not_offer_stays_text(api: str) -> None:
    clock = [
        {
            "type": "function",
            "function": {"name": "get_time", "description": "The time", "parameters": {"type": "object"}},
        }
    ]
    body = {**GREEDY, "messages": few_shot(), "tools": clock, "max_tokens": 80}
    reply = create(api, "/v1/chat/completions", body)
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"
    assert "get_weather" in reply.choices[0].message.content
    streamed = stream(api, "/v1/chat/completions", body)
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in streamed)
