"""The default model (Qwen2.5-Coder-0.5B-Instruct) through a live server and the official SDK: its own tool-call
format read back into ``tool_calls`` (whole and streamed), tool results round-tripped; thinking controls on its
template (which has no thinking) and under a template that thinks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from serving import LiveServer
from template_support import THINK_TEMPLATE

from kvmem_core.errors import ModelNotFoundError

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
GREEDY = {"temperature": 0, "max_tokens": 48}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Oslo right now?"}]
FOLLOW_UP = "So, what is the weather in Oslo? Answer in words."  # this small model calls again unless asked in words


def start(tmp: Path, *args: str) -> LiveServer:
    from kvmem.models import resolve_model

    try:
        resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return LiveServer(
        tmp, "--no-ui", "--model", DEFAULT_MODEL, "--ctx", "4096", "--kvmem-budget", "2048", *args
    ).start()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    live = start(tmp_path_factory.mktemp("default"))
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    live.stop()


def call_of(message: Any) -> tuple[str, dict[str, Any]]:
    (call,) = message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


def test_a_tool_call_in_the_models_format_is_parsed_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, **GREEDY)
    assert whole.choices[0].finish_reason == "tool_calls"
    name, args = call_of(whole.choices[0].message)
    assert name == "get_weather" and "oslo" in args["city"].lower()
    assert not whole.choices[0].message.content
    with client.beta.chat.completions.stream(model="", messages=ASK, tools=TOOLS, **GREEDY) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert call_of(final.choices[0].message) == (name, args)
    assert final.choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tool_result_round_trips_and_the_model_answers_from_it(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, **GREEDY)
    call = first.choices[0].message.tool_calls[0]
    transcript = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snowing"},
        {"role": "user", "content": FOLLOW_UP},
    ]
    answer = client.chat.completions.create(model="", messages=transcript, tools=TOOLS, **GREEDY)
    message = answer.choices[0].message
    assert not message.tool_calls and ("-3" in message.content or "snow" in message.content.lower())
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2


def test_responses_function_call_then_its_output(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": TOOLS[0]["function"]["parameters"],
        }
    ]
    first = client.responses.create(model="", input=ASK[0]["content"], tools=tools, temperature=0, max_output_tokens=48)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "oslo" in json.loads(call.arguments)["city"].lower()
    second = client.responses.create(
        model="",
        previous_response_id=first.id,
        tools=tools,
        temperature=0,
        max_output_tokens=48,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snowing"},
            {"role": "user", "content": FOLLOW_UP},
        ],
    )
    assert not [item for item in second.output if item.type == "function_call"]
    assert "-3" in second.output_text or "snow" in second.output_text.lower()
    assert second.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning_effort": "low"},
        {"reasoning_effort": "none"},
        {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_budget_tokens": 4},
    ],
)
def test_thinking_controls_leave_a_template_without_thinking_alone(
    client: openai.OpenAI, extra: dict[str, Any]
) -> None:
    plain = client.chat.completions.create(model="", messages=[{"role": "user", "content": "What is 2 + 2?"}], **GREEDY)
    asked = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "What is 2 + 2?"}], extra_body=extra, **GREEDY
    )
    assert (
        asked.choices[0].message.content == plain.choices[0].message.content and "4" in plain.choices[0].message.content
    )
    assert "reasoning_content" not in asked.choices[0].message.model_extra
    assert asked.usage.completion_tokens_details.reasoning_tokens == 0


def test_under_a_thinking_template_the_budget_ends_its_thoughts(tmp_path: Path) -> None:
    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    live = start(tmp_path, "--chat-template", str(template))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
        done = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "What is 17 * 3?"}],
            extra_body={"reasoning_budget_tokens": 4},
            temperature=0,
            max_tokens=64,
        )
        message = done.choices[0].message
        assert message.model_extra["reasoning_content"] and "51" in message.content
        assert 4 < done.usage.completion_tokens_details.reasoning_tokens <= 4 + 8  # its closing tag counts too
    finally:
        live.stop()
