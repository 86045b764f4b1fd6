"""Answers split into reasoning, content and tool calls: each template's syntax, streamed or whole."""

from __future__ import annotations

import json
import random

import pytest

from kvmem.output_parser import ChatFormat, Parsed, parse_output
from kvmem.tool_syntax import detect
from kvmem_core.reasoning import KNOWN_TAGS, think_tags

THINK = KNOWN_TAGS[0]
QWEN25 = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{%- endif %}'
)
LLAMA31 = (
    "<|start_header_id|>system<|end_header_id|>{%- if tools is not none %}Environment: ipython{%- endif %}"
    '{{- "<|python_tag|>" + tool_call.name }}{%- elif message.role == "tool" %}<|start_header_id|>ipython'
)
MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]{{ calls|tojson }}"
)
SMOLLM2 = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']}}{% endfor %}"
QWEN3 = QWEN25 + "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"


def calls_of(out: Parsed) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.calls]


@pytest.mark.parametrize(
    "template, tools, think",
    [
        (QWEN25, "hermes", None),
        (LLAMA31, "llama3", None),
        (MISTRAL, "mistral", None),
        (SMOLLM2, None, None),
        (QWEN3, "hermes", THINK),
        ("{{ messages }}{% if tools %}{{ tools }}{% endif %}", "hermes", None),
    ],
)
def test_the_template_names_its_tool_syntax_and_think_tags(template: str, tools: str | None, think: object) -> None:
    assert (detect(template), think_tags(template)) == (tools, think)
    assert ChatFormat.detect(template) == ChatFormat(tools, think)


@pytest.mark.parametrize(
    "tools, text, calls, content",
    [
        (
            "hermes",
            'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            [("f", {"a": 1}), ("g", {})],
            "Sure.",
        ),
        ("hermes", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})], ""),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})], ""),
        ("llama3", '{"name": "f", "parameters": {"x": 2}}', [("f", {"x": 2})], ""),
        (
            "llama3",
            '<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}',
            [("f", {"x": 2}), ("g", {})],
            "",
        ),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
            [("f", {"a": 1}), ("g", {})],
            "",
        ),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', [("f", {"a": 1}), ("g", {})], ""),
    ],
)
def test_each_syntax_reads_its_calls(tools: str, text: str, calls: list[tuple[str, object]], content: str) -> None:
    out = parse_output(text, ChatFormat(tools).parser(with_tools=True))
    assert calls_of(out) == calls and out.content == content


def test_mistral_calls_get_ids_its_template_accepts() -> None:
    out = parse_output(
        "[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{}[TOOL_CALLS]g[ARGS]{}", ChatFormat("mistral").parser(True)
    )
    assert out.calls[0]["id"] == "abc123XYZ"
    assert len(out.calls[1]["id"]) == 9 and out.calls[1]["id"].isalnum()


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        "x <tool_call> oops",
        '{"a": 1} is JSON',
        "  Hello {world}\n\n",
        '{"name": "f", "arguments": 3}',
    ],
)
def test_text_without_a_valid_call_stays_content_as_it_was(text: str) -> None:
    out = parse_output(text, ChatFormat("hermes").parser(with_tools=True))
    assert (out.content, out.calls, out.reasoning) == (text, [], "")


def test_without_tools_in_the_request_calls_are_text() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_output(text, ChatFormat("hermes").parser(with_tools=False)) == Parsed(content=text)


def test_a_call_to_a_tool_the_request_did_not_offer_is_text() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    out = parse_output(text, ChatFormat("hermes").parser(with_tools=True, declared=["f"]))
    assert (
        calls_of(out) == [("f", {})]
        and out.content == 'Sure.\n<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    )
    assert calls_of(parse_output(text, ChatFormat("hermes").parser(with_tools=True))) == [("rm", {}), ("f", {})]


def test_thinking_is_split_off_and_calls_inside_it_are_thoughts() -> None:
    text = (
        '<think>\nMaybe <tool_call>{"name": "g", "arguments": {}}</tool_call>?\n</think>\n\nSure.\n'
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    out = parse_output(text, ChatFormat("hermes", THINK).parser(with_tools=True))
    assert out.reasoning == 'Maybe <tool_call>{"name": "g", "arguments": {}}</tool_call>?'
    assert out.content == "Sure." and calls_of(out) == [("f", {})]


def test_an_unclosed_think_block_is_all_reasoning() -> None:
    out = parse_output("<think>\nstill thinking when the tokens ran out", ChatFormat(None, THINK).parser(False))
    assert (out.reasoning, out.content) == ("still thinking when the tokens ran out", "")


def test_templates_without_thinking_leave_think_tags_in_the_content() -> None:
    text = "<think>hm</think>ok"
    assert parse_output(text, ChatFormat().parser(False)) == Parsed(content=text)


def test_partial_tags_and_calls_are_held_back_until_certain() -> None:
    parser = ChatFormat("hermes", THINK).parser(with_tools=True)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nidea \n") == [("reasoning", "idea")]
    assert parser.feed("</think>\n\nAnswer: <tool") == [("content", "Answer:")]
    assert parser.feed('_call>{"name": "f", "arguments": {}}') == []
    ((kind, call),) = parser.feed("</tool_call>")
    assert kind == "call" and call["function"] == {"name": "f", "arguments": "{}"}
    assert parser.finish() == []


ANSWERS = [
    (
        "hermes",
        '<think>\nplan: call f\n</think>\n\nCalling.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n'
        "</tool_call>\nthen <b>done</b> ",
        True,
    ),
    ("hermes", '  {"name": "f", "arguments": {}}\n<tool_call>{"name": "g", "arguments": {}}</tool_call>', True),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}} ; {"name": "g", "parameters": {}}', True),
    ("mistral", 'Let me see. [TOOL_CALLS][{"name": "f", "arguments": {"a": "[ARGS]"}}]', True),
    ("hermes", "<think>\n\n</think>\n\nx <tool_call> oops {", True),
    (None, "<think>a</think> b <tool_call>{}</tool_call>", False),
]


@pytest.mark.parametrize("tools, text, with_tools", ANSWERS)
def test_streamed_items_add_up_to_the_whole_parse(tools: str | None, text: str, with_tools: bool) -> None:
    fmt = ChatFormat(tools, THINK)
    whole = parse_output(text, fmt.parser(with_tools))
    rng = random.Random(7)
    splits = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), 6)) for _ in range(30)]
    for cuts in splits:
        parser, streamed = fmt.parser(with_tools), Parsed()
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            for item in parser.feed(text[a:b]):
                streamed.add(item)
        for item in parser.finish():
            streamed.add(item)
        assert (streamed.reasoning, streamed.content, calls_of(streamed)) == (
            whole.reasoning,
            whole.content,
            calls_of(whole),
        ), cuts
