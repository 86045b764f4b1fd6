"""Fuzzing chat requests through the engine's own request path: any chat request, ``chat_template_kwargs`` above
all, fails alone (a 400) or renders, and the engine never restarts.

In-process (schema, conversion, wire frames, ``EngineLoop``, ``KVMemEngine`` on the small model's real tokenizer
and template), so tens of thousands of cases stay fast: four hundred in the default run, ten thousand in the slow
one. A live engine process takes the keys that used to kill it in ``test_request_fuzz``.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from kvmem import protocol as P
from kvmem.engine_proc import EngineLoop
from kvmem.output_parser import ChatFormat
from kvmem.server import schemas as S
from kvmem.server.convert import chat_step
from kvmem.server.engine_client import wire_frame
from kvmem.server.errors import APIError
from model_support import small_model
from template_support import Templated
from test_request_fuzz import json_values

from kvmem_core.config import KVMemConfig
from kvmem_core.engine import KVMemEngine
from kvmem_core.prompt import RESERVED_KWARGS

FUZZ_CONFIG = KVMemConfig(ctx=4096, budget=1024, gen_budget=256)
KWARG_KEYS = st.sampled_from(
    RESERVED_KWARGS + ("enable_thinking", "reasoning_effort", "documents", "date_string", "custom_tools", "")
) | st.text(max_size=8)
# ChatML that reads template variables the way real templates do, so odd values make it fail in odd ways
KWARGS_TEMPLATE = (
    "{% if documents %}{% for d in documents %}{{ '<|im_start|>system\\n' + d['title'] + ': ' + d.text }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name ~ c.function.arguments | tojson }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n' }}{% endif %}"
    "{{ 'Effort: ' + reasoning_effort + '\\n' if reasoning_effort is defined else '' }}"
    "{{ (date_string or '')[:10] }}{% endif %}"
)
texts = st.text(max_size=12) | st.sampled_from(["<|im_end|>", "<|im_start|>user\n", "{{ x }}", "\x00", "é東🚢"])
chat_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "user", "assistant", "tool"]),
        "content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
    },
    optional={
        "name": texts,
        "tool_call_id": texts,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"id": texts, "function": st.fixed_dictionaries({"name": texts, "arguments": texts})}
            ),
            max_size=2,
        ),
    },
)
chat_body = st.fixed_dictionaries(
    {
        "messages": st.lists(chat_message, min_size=1, max_size=6).map(
            lambda ms: ms + [{"role": "user", "content": "hi"}]
        )
    },
    optional={
        "chat_template_kwargs": st.dictionaries(KWARG_KEYS, json_values, max_size=4),
        "tools": st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {"name": st.text(min_size=1, max_size=8)},
                        optional={
                            "description": texts,
                            "parameters": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
                        },
                    ),
                }
            ),
            max_size=2,
        ),
        "tool_choice": st.sampled_from(["auto", "none"]),
        "reasoning_effort": st.sampled_from(["low", "high"]),
        "max_tokens": st.integers(1, 1 << 20),
        "stop": st.lists(texts, max_size=3),
        "temperature": st.floats(0, 2),
    },
)


class Outbox:
    """The engine process's reply socket, in memory; its inbox never has anything waiting."""

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def send(self, frame: bytes) -> None:
        self.frames.append(P.decode(frame))

    def poll(self, timeout: int) -> bool:
        return False


@pytest.fixture(scope="module")
def loops() -> Iterator[dict[str, tuple[EngineLoop, Outbox]]]:
    """An EngineLoop over KVMemEngine on the small model as it ships, and one with a template that reads kwargs."""
    pytest.importorskip("llama_cpp")
    from kvmem_llamacpp import create_adapter

    adapter = create_adapter(str(small_model()), FUZZ_CONFIG)
    engines = {
        "smollm2": KVMemEngine(adapter, FUZZ_CONFIG),
        "kwargs template": KVMemEngine(Templated(adapter, KWARGS_TEMPLATE), FUZZ_CONFIG),
    }
    out = {}
    for name, engine in engines.items():
        box = Outbox()
        out[name] = (EngineLoop(engine, box, box), box)
    yield out
    engines["smollm2"].close()


def engine_reply(loop: EngineLoop, box: Outbox, body: dict[str, Any], tools: str | None) -> Any:
    """The engine's reply to ``count_tokens`` for ``body``, or None when the server refuses it first (a 400).
    A fatal error would propagate out of the loop, which is what makes the engine process restart."""
    try:
        step = chat_step(msgspec.json.decode(json.dumps(body), type=S.ChatRequest), FUZZ_CONFIG, ChatFormat(tools))
        frame = wire_frame(P.Call(id="c", op="count_tokens", request=P.to_wire_request(step)))
    except (msgspec.DecodeError, APIError):  # the server answers 400 (a ValidationError is a DecodeError)
        return None
    box.frames.clear()
    loop.call(P.decode(frame))
    (reply,) = box.frames
    return reply


def check_engine_reply(reply: Any) -> None:
    event("refused by the server" if reply is None else reply.code if isinstance(reply, P.Failed) else "rendered")
    if isinstance(reply, P.Failed):
        assert reply.status == 400 and reply.code in ("template_error", "limit_exceeded"), reply
    else:
        assert reply is None or isinstance(reply, P.Reply) and reply.value > 0


def fuzz_engine_path(
    loops: dict[str, tuple[EngineLoop, Outbox]], body: dict[str, Any], template: str, tools: str | None
) -> None:
    loop, box = loops[template]
    check_engine_reply(engine_reply(loop, box, body, tools))


# a chat request, the template it meets (the model's own, or one reading kwargs) and the tool-call syntax asked for
ENGINE_PATH_CASES = dict(
    body=chat_body,
    template=st.sampled_from(["smollm2", "kwargs template"]),
    tools=st.sampled_from([None, "hermes", "llama3", "mistral"]),
)
SLOW_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.mark.llamacpp
@given(**ENGINE_PATH_CASES)
@settings(max_examples=400, deadline=None, suppress_health_check=SLOW_OK)
def test_any_chat_request_fails_alone_or_renders(
    loops: dict[str, tuple[EngineLoop, Outbox]], body: dict[str, Any], template: str, tools: str | None
) -> None:
    fuzz_engine_path(loops, body, template, tools)


@pytest.mark.slow
@pytest.mark.llamacpp
@given(**ENGINE_PATH_CASES)
@settings(max_examples=10_000, deadline=None, suppress_health_check=SLOW_OK)
def test_ten_thousand_chat_requests_fail_alone_or_render(
    loops: dict[str, tuple[EngineLoop, Outbox]], body: dict[str, Any], template: str, tools: str | None
) -> None:
    fuzz_engine_path(loops, body, template, tools)


@pytest.mark.llamacpp
@given(body=chat_body.map(lambda b: {**b, "max_tokens": 2}), stops=st.lists(texts, max_size=2))
@settings(max_examples=12, deadline=None, suppress_health_check=SLOW_OK)
def test_fuzzed_chat_steps_run_or_fail_alone(
    loops: dict[str, tuple[EngineLoop, Outbox]], body: dict[str, Any], stops: list[str]
) -> None:
    loop, box = loops["kwargs template"]
    try:
        step = chat_step(
            msgspec.json.decode(json.dumps({**body, "stop": stops}), type=S.ChatRequest), FUZZ_CONFIG, ChatFormat()
        )
        frame = wire_frame(P.Step(id="s", request=P.to_wire_request(step)))
    except (msgspec.DecodeError, APIError):  # the server answers 400 (a ValidationError is a DecodeError)
        return
    box.frames.clear()
    loop.step(P.decode(frame))
    last = box.frames[-1]
    assert isinstance(last, P.Done) or isinstance(last, P.Failed) and last.status in (400, 413), last
