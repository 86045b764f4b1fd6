"""Request bodies -> engine steps, and every failure -> one status and the OpenAI error JSON."""

from __future__ import annotations

import json

import msgspec
import pytest
from aiohttp import web

from kvmem.output_parser import ChatFormat
from kvmem.server import convert
from kvmem.server import schemas as S
from kvmem.server.errors import APIError, to_api_error
from kvmem_core.config import KVMemConfig
from kvmem_core.errors import BudgetError, CapacityError, ContextLengthError, UnsupportedModelError

CONFIG = KVMemConfig()


def chat(**fields: object) -> S.ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=S.ChatRequest)


def error_of(fn: object, *args: object, **kwargs: object) -> APIError:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    return to_api_error(info.value)


def test_chat_step_carries_sampling_and_template_kwargs() -> None:
    step = convert.chat_step(
        chat(
            temperature=0,
            top_p=0.5,
            top_k=3,
            seed=7,
            stop="END",
            max_tokens=9,
            reasoning_effort="low",
            chat_template_kwargs={"enable_thinking": False},
        ),
        CONFIG,
        ChatFormat(),
    )
    s = step.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, s.stop) == (0, 0.5, 3, 7, 9, ("END",))
    assert step.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert step.messages == ({"role": "user", "content": "hi"},)
    assert step.prompt is None and step.overrides == {}


def test_without_max_tokens_the_server_default_applies_else_the_room_left() -> None:
    assert (
        convert.chat_step(chat(), CONFIG, ChatFormat()).sampling.max_tokens is None
    )  # the engine: --ctx less the prompt
    assert convert.chat_step(chat(), CONFIG, ChatFormat(), default_max=50).sampling.max_tokens == 50
    assert convert.chat_step(chat(max_tokens=9), CONFIG, ChatFormat(), default_max=50).sampling.max_tokens == 9
    assert convert.chat_step(chat(max_tokens=9, max_completion_tokens=7), CONFIG, ChatFormat()).sampling.max_tokens == 7


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert (
        convert.chat_step(chat(max_tokens=5, max_completion_tokens=11), CONFIG, ChatFormat()).sampling.max_tokens == 11
    )


def test_content_parts_join_and_developer_becomes_system() -> None:
    body = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert convert.chat_step(body, CONFIG, ChatFormat()).messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    )


def test_kvmem_object_becomes_config_overrides() -> None:
    body = chat(kvmem={"method": "recency", "retrieval_method": "mean-k", "budget": 1024, "retrieval_heads": "3:1,4:2"})
    assert convert.chat_step(body, CONFIG, ChatFormat()).overrides == {
        "method": "recency",
        "scorer": "mean-k",
        "budget": 1024,
        "retrieval_heads": ((3, 1), (4, 2)),
    }


@pytest.mark.parametrize(
    "kvmem, param",
    [
        ({"method": "magic"}, "kvmem"),
        ({"budget": 100}, "kvmem"),
        ({"retrieval_heads": "x"}, "kvmem"),
        ({"budget": 100_000}, "kvmem"),
        ({"gen_budget": 4096}, "kvmem"),
    ],
)
def test_bad_kvmem_values_are_400(kvmem: dict[str, object], param: str) -> None:
    err = error_of(convert.chat_step, chat(kvmem=kvmem), CONFIG, ChatFormat())
    assert (err.status, err.param, err.code) == (400, param, "invalid_kvmem_options")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "kvmem": {"budgte": 5}}, "kvmem"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": "hello"}, "messages"),
        ({}, None),
    ],
)
def test_schema_violations_are_400_with_the_param(body: dict[str, object], param: str | None) -> None:
    err = error_of(msgspec.json.decode, json.dumps(body).encode(), type=S.ChatRequest)
    assert err.status == 400
    assert err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "system", "content": "only a system prompt"}], "messages"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ],
)
def test_semantic_violations_are_400(messages: list[dict[str, object]], param: str) -> None:
    err = error_of(convert.chat_step, chat(messages=messages), CONFIG, ChatFormat())
    assert (err.status, err.param) == (400, param)


def test_malformed_json_is_400() -> None:
    err = error_of(msgspec.json.decode, b'{"messages": [', type=S.ChatRequest)
    assert (err.status, err.code) == (400, "invalid_json")


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (ContextLengthError("too long"), 400, "context_length_exceeded"),
        (BudgetError("mandatory spans"), 413, "budget_exceeded"),
        (CapacityError("full"), 507, "storage_full"),
        (UnsupportedModelError("arch"), 400, "unsupported_model"),
        (web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2), 413, "body_too_large"),
        (RuntimeError("bug"), 500, "internal_error"),
    ],
)
def test_error_mapping(exc: BaseException, status: int, code: str) -> None:
    err = to_api_error(exc)
    assert (err.status, err.code) == (status, code)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_step_takes_the_prompt() -> None:
    body = msgspec.json.decode(
        b'{"prompt": ["The sky is"], "max_tokens": 4, "stop": ["\\n"]}', type=S.CompletionRequest
    )
    step = convert.completion_step(body, CONFIG)
    assert (step.prompt, step.messages, step.sampling.max_tokens, step.sampling.stop) == (
        "The sky is",
        None,
        4,
        ("\n",),
    )
    err = error_of(convert.completion_step, msgspec.json.decode(b'{"prompt": ""}', type=S.CompletionRequest), CONFIG)
    assert (err.status, err.param) == (400, "prompt")


def test_tools_become_plain_text_when_the_template_lacks_them() -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    plain = convert.chat_step(chat(tools=tools), CONFIG, ChatFormat())
    assert plain.tools is None and "<tools>" in plain.messages[0]["content"]
    native = convert.chat_step(chat(tools=tools), CONFIG, ChatFormat("hermes"))
    assert native.tools == tuple(msgspec.to_builtins(msgspec.convert(tools, list[S.ChatTool])))
    assert native.messages == ({"role": "user", "content": "hi"},)
    assert convert.chat_step(chat(tools=tools, tool_choice="none"), CONFIG, ChatFormat()).messages == native.messages
