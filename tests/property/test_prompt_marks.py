"""A prompt whose message ends carry over from the adapter's last request equals the same prompt marked from scratch
(``kvmem_core.marks``): transcripts grown, edited in the middle, cut back and changed in type only (``1`` for
``True``), under templates that render a message by what follows it (the last message marked; reasoning dropped
before the last user turn; a value rendered only at the end of the text), with multi-byte text."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem_core.contract import StepRequest
from kvmem_core.prompt import build_prompt

Template = Callable[[Sequence[dict[str, Any]], bool], str]


def plain(messages: Sequence[dict[str, Any]], prompt: bool) -> str:
    return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + ("<a>" if prompt else "")


def last_marked(messages: Sequence[dict[str, Any]], prompt: bool) -> str:
    n = len(messages)
    return "".join(f"<{m['role']}{'*' * (i == n - 1)}>{m['content']}</>" for i, m in enumerate(messages)) + (
        "<a>" if prompt else ""
    )


def reasoning_dropped(messages: Sequence[dict[str, Any]], prompt: bool) -> str:
    """Like Qwen3's: an assistant turn's reasoning shows only after the last user turn."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last_user = users[-1] if users else -1
    out = []
    for i, m in enumerate(messages):
        think = f"[{m.get('reasoning', '')}]" if m["role"] == "assistant" and i > last_user else ""
        out.append(f"<{m['role']}>{think}{m['content']}</>")
    return "".join(out) + ("<a>" if prompt else "")


def tail_valued(messages: Sequence[dict[str, Any]], prompt: bool) -> str:
    """Each message's ``n`` (a number or a bool) written only at the end of the whole text."""
    return plain(messages, prompt) + "".join(f"{m['n']}," for m in messages if "n" in m)


TEMPLATES = [plain, last_marked, reasoning_dropped, tail_valued]


class Chat:
    """A template and a character tokenizer."""

    def __init__(self, template: Template) -> None:
        self.template = template

    def render_chat(self, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
        return self.template(messages, add_generation_prompt)

    def token_array(self, text: str) -> np.ndarray:
        return np.array([ord(c) for c in text], dtype=np.int64)

    def token_bytes(self, token: int) -> bytes:
        return chr(token).encode()


contents = st.text(st.sampled_from(list("ab <>/é東🚢")), max_size=6)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": contents},
    optional={"reasoning": contents, "n": st.sampled_from([1, True, 1.0, 2])},
)
changes = st.one_of(
    st.tuples(st.just("grow"), st.lists(message, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.integers(0, 20), message),
    st.tuples(st.just("drop"), st.integers(0, 20)),
    st.tuples(st.just("retype"), st.integers(0, 20)),
)


def change(transcript: list[dict[str, Any]], what: tuple[Any, ...]) -> list[dict[str, Any]]:
    if what[0] == "grow":
        return transcript + what[1]
    if not transcript:
        return transcript
    i = what[1] % len(transcript)
    if what[0] == "edit":
        return [*transcript[:i], what[2], *transcript[i + 1 :]]
    if what[0] == "drop":
        return transcript[: i + 1]
    n = transcript[i].get("n", 1)
    retyped = {bool: int, int: bool, float: int}[type(n)](n)  # 1 and True: equal under ==, rendered apart
    return [*transcript[:i], {**transcript[i], "n": retyped}, *transcript[i + 1 :]]


@given(template=st.sampled_from(TEMPLATES), first=st.lists(message, min_size=1, max_size=4), turns=st.lists(changes))
@settings(max_examples=300, deadline=None)
def test_marks_carried_over_equal_marks_from_scratch(
    template: Template, first: list[dict[str, Any]], turns: list[tuple[Any, ...]]
) -> None:
    chat, transcript = Chat(template), [{"role": "system", "content": "sys é"}, *first]
    for what in [("grow", []), *turns]:
        transcript = change(transcript, what)
        request = StepRequest(messages=tuple(transcript))
        assert build_prompt(chat, request) == build_prompt(Chat(template), request)
