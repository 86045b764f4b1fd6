"""Prompt spans from one render and one tokenization equal those of rendering and tokenizing every
prefix (the algorithm ``build_prompt`` replaced, kept here as the reference), on the small model's
tokenizer under several chat templates; and building stays linear in the number of messages."""

from __future__ import annotations

from typing import Any, Iterator

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvmem_bench.prompt import agent_transcript, measure
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import StepRequest
from kvmem_core.groups import token_groups
from kvmem_core.prompt import Prompt, build_prompt
from kvmem_llamacpp.adapter import CHATML_TEMPLATE
from llamacpp_support import model_path
from template_support import Templated

pytestmark = pytest.mark.llamacpp

# Gemma-like: turns must alternate from a user turn (a system prompt joins the first one), so an
# assistant message alone does not render; assistant turns are numbered, so they render differently alone.
ALTERNATING = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] + '\\n\\n' %}"
    "{% set rest = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + (' ' + loop.index|string if m['role'] == 'assistant' else '') + '\\n' }}"
    "{{ (sys if loop.first else '') + m['content'] | trim + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Tools in a system block before everything; a template variable from chat_template_kwargs.
TOOLS_HEADER = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + tools | map(attribute='name') | join(', ') + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' + ('<think>\\n' if thinking else '') }}{% endif %}"
)


def quadratic_prompt(adapter: Any, request: StepRequest) -> Prompt:
    """The replaced algorithm: message ``i`` ends at the token count of messages ``[:i+1]`` rendered and tokenized."""
    messages, kw = [dict(m) for m in request.messages], dict(tools=request.tools, **request.template_kwargs)
    ids = adapter.tokenize(adapter.render_chat(messages, add_generation_prompt=True, **kw))
    ends = [
        min(len(adapter.tokenize(adapter.render_chat(messages[: i + 1], add_generation_prompt=False, **kw))), len(ids))
        for i in range(len(messages))
    ]
    starts = [0] + ends[:-1]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    query_start = starts[users[-1]] if users else starts[-1]
    mandatory = tuple((starts[i], ends[i]) for i, m in enumerate(messages) if m["role"] in ("system", "developer"))
    mandatory += tool_definitions(adapter, messages[0], kw, len(ids))
    return Prompt(
        ids,
        min(query_start, max(0, len(ids) - 1)),
        mandatory,
        tuple(zip(starts, ends)),
        token_groups(messages, starts, ends),
    )


def tool_definitions(adapter: Any, first: dict[str, Any], kw: dict[str, Any], n: int) -> tuple[tuple[int, int], ...]:
    """The tokens where the first message rendered alone with tools and without differ, found char by char."""
    if not kw["tools"]:
        return ()
    a = adapter.render_chat([first], add_generation_prompt=False, **kw)
    b = adapter.render_chat([first], add_generation_prompt=False, **{**kw, "tools": None})
    if a == b:
        return ()
    head = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    tail = 0
    while tail < len(b) - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    return ((min(len(adapter.tokenize(a[:head])), n), min(len(adapter.tokenize(a[: len(a) - tail])), n)),)


@pytest.fixture(scope="module")
def smollm() -> Iterator[Any]:
    from kvmem_llamacpp import create_adapter

    adapter = create_adapter(str(model_path()), KVMemConfig(ctx=4096, budget=1024, gen_budget=256))
    yield adapter
    adapter.close()


def turns(*pairs: tuple[str, str]) -> tuple[dict[str, str], ...]:
    return tuple({"role": r, "content": c} for r, c in pairs)


TRANSCRIPTS = {
    "agent": agent_transcript(40, words=30),
    "alternating": turns(
        ("system", "Be brief."), *[(("user", "assistant")[i % 2], f"turn {i} " * (i % 5)) for i in range(21)]
    ),
    "no system": turns(("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Name a colour.")),
    "odd contents": turns(
        ("system", "Be brief.\n\n"),
        ("user", "user"),
        ("assistant", ""),
        ("user", "\n"),
        ("assistant", "<|im_end|>"),
        ("user", "naïve café — 東京 🚢?"),
    ),
    "tool turn last": turns(
        ("system", "You call tools."),
        ("user", "Weather?"),
        ("assistant", "Checking."),
        ("user", '<tool_response>\n{"temp": 21}\n</tool_response>'),
    ),
}
TEMPLATES = {"smollm2": None, "chatml": CHATML_TEMPLATE, "alternating": ALTERNATING, "tools header": TOOLS_HEADER}


CASES = [
    (t, x)
    for t in sorted(TEMPLATES)
    for x in sorted(TRANSCRIPTS)
    if t != "alternating" or x in ("alternating", "no system")
]


@pytest.mark.parametrize(("template", "transcript"), CASES)
def test_spans_equal_the_prefix_by_prefix_reference(smollm: Any, template: str, transcript: str) -> None:
    adapter = smollm if TEMPLATES[template] is None else Templated(smollm, TEMPLATES[template])
    request = StepRequest(
        messages=TRANSCRIPTS[transcript], tools=({"name": "get_weather"},), template_kwargs={"thinking": True}
    )
    assert build_prompt(adapter, request) == quadratic_prompt(adapter, request)


contents = st.lists(st.sampled_from(list("ab \n.<|>é東") + ["<|im_end|>", "<|im_start|>", "user"]), max_size=12).map(
    "".join
)
transcripts = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant", "developer"]), contents), min_size=1, max_size=10
)


@given(pairs=transcripts, template=st.sampled_from(["smollm2", "chatml", "tools header"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_spans_equal_the_reference_on_any_transcript(smollm: Any, pairs: list[tuple[str, str]], template: str) -> None:
    adapter = smollm if TEMPLATES[template] is None else Templated(smollm, TEMPLATES[template])
    request = StepRequest(messages=turns(*pairs), template_kwargs={"thinking": False})
    assert build_prompt(adapter, request) == quadratic_prompt(adapter, request)


def test_500_messages_cost_at_most_twice_one_render_and_tokenize(smollm: Any) -> None:
    row = measure(smollm, n_messages=500)
    assert row["tokens"] > 50_000
    assert row["ratio"] <= 2.0, row
    assert row["next_turn_s"] <= row["build_prompt_s"] / 2, row  # the next turn tokenizes what it adds
