"""Thinking end to end: a live ``kvmem serve --chat-template`` with a tiny template that thinks (the small
model under it), the official SDK and the web UI in Chromium. The budget ends a think block, thinking streams
as ``reasoning_content`` and Responses reasoning items, and switching it off renders the template's closed block."""

from __future__ import annotations

import re
from typing import Any, Iterator

import openai
import pytest
from playwright.sync_api import expect
from serving import LiveServer
from template_support import THINK_TEMPLATE
from webui_support import browser, new_page  # noqa: F401

pytestmark = pytest.mark.llamacpp
ASK = [{"role": "user", "content": "Explain briefly why the sky is blue."}]
BUDGET = 12
CLOSE_TOKENS = 4  # "\n", "</", "think", ">": the forced closing tag's tokens inside the block (SmolLM2)
GREEDY: dict[str, Any] = {"model": "", "temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("thinking")
    template = tmp / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    live = LiveServer(tmp, "--chat-template", str(template), "--kvmem-retrieval-heads", "17:3,17:4,21:8").start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def reasoning_tokens(usage: Any) -> int:
    return usage.completion_tokens_details.reasoning_tokens


def test_the_budget_ends_thinking_and_the_answer_follows(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(messages=ASK, extra_body={"reasoning_budget_tokens": BUDGET}, **GREEDY)
    message = whole.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and message.content and "think>" not in thought + message.content
    assert reasoning_tokens(whole.usage) == BUDGET + CLOSE_TOKENS
    chunks = list(
        client.chat.completions.create(
            messages=ASK,
            extra_body={"reasoning_budget_tokens": BUDGET},
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == message.content
    assert reasoning_tokens(chunks[-1].usage) == BUDGET + CLOSE_TOKENS


def test_without_a_budget_the_model_thinks_until_max_tokens(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(messages=ASK, **GREEDY)
    assert done.choices[0].finish_reason == "length" and not done.choices[0].message.content
    assert reasoning_tokens(done.usage) == done.usage.completion_tokens


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}])
def test_thinking_switched_off_renders_the_closed_block(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    done = client.chat.completions.create(messages=ASK, extra_body=extra, **GREEDY)
    assert done.choices[0].message.content and "reasoning_content" not in done.choices[0].message.model_extra
    assert reasoning_tokens(done.usage) == 0


def test_responses_stream_a_reasoning_item_and_take_it_back_as_input(client: openai.OpenAI) -> None:
    with client.responses.stream(
        input=ASK[0]["content"],
        model="",
        temperature=0,
        max_output_tokens=40,
        extra_body={"reasoning_budget_tokens": BUDGET},
    ) as stream:
        events = list(stream)
    final = events[-1].response  # a cut answer ends with response.incomplete, which get_final_response refuses
    assert events[-1].type == f"response.{final.status}" and final.status in ("completed", "incomplete")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed and streamed == final.output[0].content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == BUDGET + CLOSE_TOKENS
    again = client.responses.create(
        model="",
        temperature=0,
        max_output_tokens=8,
        input=[
            *ASK,
            *[item.model_dump(exclude_none=True) for item in final.output],
            {"role": "user", "content": "Shorter?"},
        ],
    )
    assert again.status in ("completed", "incomplete") and again.output


def test_the_web_ui_folds_a_live_answers_thinking(server: LiveServer, browser, request) -> None:  # noqa: F811
    page = new_page(browser, request)
    page.goto(server.url + "/")
    page.click("#toggle-settings")
    for name, value in (("temperature", "0"), ("maxTokens", "40"), ("thinkingBudget", str(BUDGET))):
        page.fill(f"#settings-form [name={name}]", value)
        page.locator(f"#settings-form [name={name}]").press("Tab")
    page.click("#toggle-settings")
    page.fill("#prompt", ASK[0]["content"])
    page.press("#prompt", "Enter")
    answer = page.locator("#messages .msg-assistant").last
    expect(answer).not_to_have_class(re.compile("streaming"), timeout=60_000)
    think = answer.locator("details.think")
    expect(think.locator("summary")).to_have_text("Thoughts")
    assert think.get_attribute("open") is None  # open while thinking, folded once the answer began
    assert answer.locator(".markdown").last.inner_text().strip()
    think.locator("summary").click()
    expect(think).to_have_attribute("open", "")
    assert page.errors == []
