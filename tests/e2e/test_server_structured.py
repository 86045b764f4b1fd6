"""Structured output on a live server with the small test model, through the official SDK's own helpers
(``chat.completions.parse``, ``responses.parse``): every answer parses and validates against its schema, streamed
or not, and strict tool calls carry arguments of their tool's schema. Bodies and events are checked against the
SDK's types."""

from __future__ import annotations

import json
from typing import Any, Iterator, Literal

import openai
import pytest
from pydantic import BaseModel
from sdk_types import create, post, stream
from serving import LiveServer

pytestmark = pytest.mark.llamacpp
pytest.importorskip("llguidance")
ASKS = ("Describe Paris.", "Tell me about the city of Lima in Peru.", "Write about Oslo in winter.")


class City(BaseModel):
    name: str
    country: str
    population: int
    landmarks: list[str]
    climate: Literal["cold", "mild", "hot"]


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
STRICT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    live = LiveServer(tmp_path_factory.mktemp("structured"), "--no-ui", "--ctx", "4096").start()
    yield live.url
    live.stop()


@pytest.fixture(scope="module")
def client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("ask", ASKS)
def test_chat_json_schema_answers_parse_into_the_model(client: openai.OpenAI, ask: str) -> None:
    done = client.chat.completions.parse(
        model="", messages=[{"role": "user", "content": ask}], response_format=City, temperature=0
    )
    assert isinstance(done.choices[0].message.parsed, City) and done.choices[0].finish_reason == "stop"


def test_a_short_max_tokens_still_closes_the_json(api: str) -> None:
    body = {
        "model": "",
        "temperature": 0,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": ASKS[0]}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "City", "strict": True, "schema": City.model_json_schema()},
        },
    }
    City.model_validate_json(create(api, "/v1/chat/completions", body).choices[0].message.content)


def test_streamed_json_object_and_json_schema_parse(api: str) -> None:
    body = {
        "model": "",
        "temperature": 0,
        "messages": [{"role": "user", "content": ASKS[1]}],
        "response_format": {"type": "json_object"},
    }
    chunks = stream(api, "/v1/chat/completions", body)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "City", "strict": True, "schema": City.model_json_schema()},
    }
    chunks = stream(api, "/v1/chat/completions", {**body, "response_format": schema})
    City.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_responses_text_format_parses_and_is_echoed(client: openai.OpenAI, api: str) -> None:
    done = client.responses.parse(model="", input=ASKS[2], text_format=City, temperature=0)
    assert (
        isinstance(done.output_parsed, City)
        and done.text.format.type == "json_schema"
        and done.text.format.name == "City"
    )
    body = {
        "model": "",
        "temperature": 0,
        "input": ASKS[0],
        "text": {"format": {"type": "json_schema", "name": "City", "strict": True, "schema": City.model_json_schema()}},
    }
    events = stream(api, "/v1/responses", body)
    City.model_validate_json(events[-1].response.output_text)


def test_strict_tools_get_arguments_of_their_schema(api: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"model": "", "temperature": 0, "messages": ask, "tools": STRICT_TOOLS, "tool_choice": choice}
        done = create(api, "/v1/chat/completions", body).choices[0]
        assert done.finish_reason == "tool_calls" and done.message.tool_calls
        for call in done.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    tools = [{"type": "function", "name": "get_weather", "strict": True, "parameters": WEATHER}]
    done = create(
        api, "/v1/responses", {"model": "", "temperature": 0, "input": ask, "tools": tools, "tool_choice": "required"}
    )
    (call,) = [item for item in done.output if item.type == "function_call"][:1]
    assert set(json.loads(call.arguments)) == {"city", "unit"}


def test_messages_output_format_and_a_bad_schema(api: str) -> None:
    body: dict[str, Any] = {
        "model": "",
        "max_tokens": 400,
        "temperature": 0,
        "messages": [{"role": "user", "content": ASKS[0]}],
        "output_format": {"type": "json_schema", "schema": City.model_json_schema()},
    }
    City.model_validate_json(post(api, "/v1/messages", body).json()["content"][0]["text"])
    bad = {
        "model": "",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "strict": True, "schema": {"type": "string", "format": "no-such"}},
        },
    }
    reply = post(api, "/v1/chat/completions", bad)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_response_format"
